"""`pagoda bench step-time`: a step-time profile of this machine for `pagoda simulate`,
measured on real steps of the real engine, and the simulator checked against them.

The real engine runs a trace whose requests all arrive at once (so the schedule depends on
nothing but the engine's state); every step's shape and the worker's compute time are
recorded. A linear model of step time is fitted on half the steps and its error measured
on the other half, then fitted on all of them and saved (``--output``, the profile that
``pagoda simulate --device FILE`` reads). Finally the simulator runs the same trace with the
same configuration and that profile, and its step-by-step schedule (which requests, how
many tokens each) is compared with the real one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

from pagoda.engine.args import add_engine_args, engine_config_from_args


@dataclass(slots=True)
class StepRecorder:
    """The engine core's step observer: each step's shape and schedule when sent, its
    compute and idle time when answered.

    Attributes:
        index_of: Trace index of each prompt (by its token ids): the real engine names
            requests its own way; the simulator names them by trace index.
    """

    requests: dict
    index_of: dict[tuple[int, ...], int]
    ids: dict[str, int] = field(default_factory=dict)
    shapes: list = field(default_factory=list)
    schedules: list[dict[int, int]] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)

    def sent(self, scheduler_output) -> None:
        from pagoda.simulator.step_time import step_shape

        for new in scheduler_output.new_requests:
            self.ids[new.request_id] = self.index_of[tuple(new.prompt_token_ids)]
        self.shapes.append(step_shape(scheduler_output, self.requests)[0])
        self.schedules.append({self.ids[r]: n for r, n in scheduler_output.num_scheduled_tokens.items()})

    def answered(self, scheduler_output, runner_output) -> None:
        self.compute.append(runner_output.compute_seconds)
        self.idle.append(runner_output.idle_seconds)


async def record_steps(config, trace, warm_up: int = 4) -> tuple[StepRecorder, object, object, str, float]:
    """Runs the trace (every request at once) on a real engine.

    Returns:
        The recorder, the engine's KV cache size, its model config, the dtype it ran, and
        the run's wall time.
    """
    from pagoda.engine.frontend.async_engine import AsyncEngine
    from pagoda.engine.frontend.output_processor import OutputKind
    from pagoda.engine.sampling_params import SamplingParams
    from pagoda.simulator.trace import TraceRequest, prompt_token_ids

    async def consume(engine, stream) -> None:
        async for _ in engine.stream_outputs(stream):
            pass

    async with AsyncEngine(config) as engine:
        vocab = engine.model_config.vocab_size
        kv = engine.kv_cache_size
        # NOTE: warm-up prompts (compilation of the first shapes) from indices the trace
        # does not use, so they share no block with it.
        warm = [prompt_token_ids(TraceRequest(0, 8 + 24 * i, 4), len(trace) + i, vocab) for i in range(warm_up)]
        await asyncio.gather(*(consume(engine, engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True),
                                                                  output_kind=OutputKind.FINAL)) for p in warm))
        prompts = [prompt_token_ids(r, i, vocab) for i, r in enumerate(trace)]
        recorder = StepRecorder(engine.scheduler.requests, {tuple(p): i for i, p in enumerate(prompts)})
        engine.core.step_observer = recorder
        start = time.perf_counter()
        streams = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=min(r.output_len, kv.max_model_len -
                                                                                       r.prompt_len), ignore_eos=True),
                                      output_kind=OutputKind.FINAL) for p, r in zip(prompts, trace)]
        await asyncio.gather(*(consume(engine, s) for s in streams))
        wall = time.perf_counter() - start
        engine.core.step_observer = None
        return recorder, kv, engine.model_config, str(engine.worker.ready.dtype).removeprefix("torch."), wall


async def replay(config, trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sends the trace's requests to a real engine at their arrival times (from a client in
    the same event loop), streaming each.

    Returns:
        Per request: time to first token, time per output token after the first (NaN with
        one token) and end-to-end latency, in seconds.
    """
    from pagoda.engine.frontend.async_engine import AsyncEngine
    from pagoda.engine.frontend.output_processor import OutputKind
    from pagoda.engine.sampling_params import SamplingParams
    from pagoda.simulator.trace import TraceRequest, prompt_token_ids

    async with AsyncEngine(config) as engine:
        vocab, max_len = engine.model_config.vocab_size, engine.kv_cache_size.max_model_len
        warm = prompt_token_ids(TraceRequest(0, 40, 4), len(trace), vocab)
        async for _ in engine.stream_outputs(engine.add_request(warm, SamplingParams(max_tokens=4, ignore_eos=True))):
            pass
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(index: int, request: TraceRequest) -> tuple[float, float, float]:
            await asyncio.sleep(max(0.0, start + request.arrival - loop.time()))
            sent = time.perf_counter()
            params = SamplingParams(temperature=0, max_tokens=min(request.output_len, max_len - request.prompt_len),
                                    ignore_eos=True)
            stream = engine.add_request(prompt_token_ids(request, index, vocab), params, output_kind=OutputKind.DELTA)
            first, tokens = None, 0
            async for output in engine.stream_outputs(stream):
                if first is None:
                    first = time.perf_counter()
                tokens += len(output.outputs[0].token_ids)
            end = time.perf_counter()
            return first - sent, (end - first) / (tokens - 1) if tokens > 1 else math.nan, end - sent

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
    ttft, tpot, e2e = (np.array(column) for column in zip(*results))
    return ttft, tpot, e2e


def compare_latencies(config, kv, vocab_size: int, trace, profile) -> dict:
    """The real engine under the trace's arrivals against the simulator with ``profile``:
    TTFT, TPOT and E2E at p50 and p90, and the simulation's error in %."""
    from pagoda.engine.frontend.llm import new_event_loop
    from pagoda.simulator.report import latencies

    loop = new_event_loop()
    try:
        real = dict(zip(("ttft", "tpot", "e2e"), loop.run_until_complete(replay(config, trace))))
    finally:
        loop.close()
    simulated = latencies(_simulation(config, kv, profile, vocab_size).run(trace, progress=False))
    report = {}
    for name in ("ttft", "tpot", "e2e"):
        for q in (50, 90):
            measured = float(np.nanpercentile(real[name], q))
            predicted = float(np.nanpercentile(simulated[name], q))
            report[f"{name}_p{q}"] = {"real_s": round(measured, 4), "simulated_s": round(predicted, 4),
                                      "error_pct": round((predicted - measured) / measured * 100, 1)}
    return report


def _simulation(config, kv, profile, vocab_size: int, record_steps: bool = False):
    from pagoda.engine.core.plugin_manager import create_plugin_manager
    from pagoda.engine.core.policy import Policy
    from pagoda.simulator.simulator import Simulation

    return Simulation(config, kv, profile, lambda: Policy(create_plugin_manager(config.plugins),
                                                          config.scheduling_policy, config.eviction_policy),
                      vocab_size, record_steps=record_steps)


def compare_schedules(real: list[dict[int, int]], simulated: list[dict[int, int]]) -> dict:
    """Whether two step sequences schedule the same requests and tokens, and where they
    first differ."""
    first = next((i for i, (a, b) in enumerate(zip(real, simulated)) if a != b), None)
    if first is None and len(real) != len(simulated):
        first = min(len(real), len(simulated))
    return {"real_steps": len(real), "simulated_steps": len(simulated), "identical": first is None,
            "first_difference": first,
            "at_first_difference": None if first is None else {
                "real": real[first] if first < len(real) else None,
                "simulated": simulated[first] if first < len(simulated) else None}}


def measure(config, trace, arrivals_trace=None) -> dict:
    """Records the real steps, fits the profile, simulates the trace with it and compares;
    with ``arrivals_trace``, also compares latencies under its arrivals (compare_latencies).

    Returns:
        The report (JSON-ready), with ``profile`` the FittedProfile fitted on every step.
    """
    from pagoda.engine.frontend.llm import new_event_loop
    from pagoda.simulator.step_time import (FittedProfile, Roofline, cpu_model_name, fit_profile, model_summary,
                                            percent_error, probe_cpu)

    loop = new_event_loop()
    try:
        recorder, kv, model, dtype, wall = loop.run_until_complete(record_steps(config, trace))
    finally:
        loop.close()
    # NOTE: steps with no tokens (only dropping finished requests) cost the worker nothing
    # worth modelling; they are left out of the fit and the errors.
    dtype_bytes = 4 if dtype == "float32" else 2
    kv_dtype_bytes = dtype_bytes if config.kv_cache_dtype == "auto" else 1  # the fp8 formats
    rows = [i for i, s in enumerate(recorder.schedules) if s]
    shapes = [recorder.shapes[i] for i in rows]
    seconds = [recorder.compute[i] for i in rows]
    half, other = rows[0::2], rows[1::2]
    fitted_half, _ = fit_profile([recorder.shapes[i] for i in half], [recorder.compute[i] for i in half])
    held_out = FittedProfile(fitted_half)
    held_out_predicted = [held_out.step_seconds(recorder.shapes[i]) for i in other]
    held_out_measured = [recorder.compute[i] for i in other]
    held_out_error = percent_error(held_out_predicted, held_out_measured)
    roofline = Roofline(probe_cpu(), model, dtype_bytes, kv_dtype_bytes)
    roofline_error = percent_error([roofline.step_seconds(recorder.shapes[i]) for i in other],
                                   [recorder.compute[i] for i in other])
    coefficients, fit_error = fit_profile(shapes, seconds)
    idle = [recorder.idle[i] for i in rows[1:]]
    overhead = sum(idle) / len(idle) if idle and not config.async_scheduling else 0.0
    profile = FittedProfile(coefficients, engine_overhead_s=overhead, device=cpu_model_name(),
                            model=model_summary(model), dtype=dtype, kv_dtype_bytes=kv_dtype_bytes,
                            fit={"steps": len(rows), "mean_abs_error_pct_in_sample": round(fit_error, 2),
                                 "held_out": held_out_error, "async_scheduling": bool(config.async_scheduling),
                                 "max_num_batched_tokens": config.max_num_batched_tokens})

    result = _simulation(config, kv, profile, model.vocab_size, record_steps=True).run(trace, progress=False)
    simulated = [{int(r): n for r, n in step.scheduled.items()} for step in result.steps]
    schedule = compare_schedules(recorder.schedules, simulated)
    predicted_total = float(np.nanmax(result.finish))
    return {"cpu": cpu_model_name(), "dtype": dtype, "model": model_summary(model), "requests": len(trace),
            "steps": len(rows),
            "schedule": schedule, "held_out_step_error": held_out_error, "cpu_roofline_step_error": roofline_error,
            "cpu_roofline": roofline.describe(), "in_sample_error_pct": round(fit_error, 2),
            "real_wall_s": round(wall, 3), "real_compute_s": round(sum(seconds), 3),
            "simulated_s": round(predicted_total, 3),
            "end_to_end_error_pct": round((predicted_total - wall) / wall * 100, 2),
            "preemptions": result.num_preemptions, "prefix_cache_hit_rate": round(
                result.prompt_tokens_cached / max(result.prompt_tokens, 1), 4),
            "latencies": None if arrivals_trace is None else compare_latencies(config, kv, model.vocab_size,
                                                                                arrivals_trace, profile),
            "held_out_steps": {"predicted_s": held_out_predicted, "measured_s": held_out_measured,
                               "tokens": [recorder.shapes[i].num_tokens for i in other]},
            "profile": profile}


def run_step_time_bench(args: argparse.Namespace) -> int:
    from pagoda.simulator.trace import synthetic_trace

    config = engine_config_from_args(args)
    if config.async_scheduling is None:
        config.async_scheduling = False
    trace = synthetic_trace(args.num_requests, float("inf"), args.prompt_len, args.output_len, seed=args.bench_seed)
    arrivals = None
    if args.arrival_rate:
        arrivals = synthetic_trace(args.arrival_requests, args.arrival_rate, args.prompt_len, args.output_len,
                                   seed=args.bench_seed + 1)
    report = measure(config, trace, arrivals)
    profile = report.pop("profile")
    if args.output:
        profile.save(args.output)
    held, schedule = report["held_out_step_error"], report["schedule"]
    print(f"{report['requests']} requests, {report['steps']} steps on {report['cpu']}")
    print(f"profile: {profile.describe()}; engine overhead {profile.engine_overhead_s * 1e3:.2f} ms a step")
    print(f"held-out step time error: mean {held['mean_abs_error_pct']:.1f}%, median "
          f"{held['median_abs_error_pct']:.1f}%, total {held['total_error_pct']:+.1f}% ({held['steps']} steps)")
    roof = report["cpu_roofline_step_error"]
    print(f"the same steps by `--device cpu` ({report['cpu_roofline']}): mean error "
          f"{roof['mean_abs_error_pct']:.1f}%, total {roof['total_error_pct']:+.1f}%")
    print(f"simulated schedule {'identical to' if schedule['identical'] else 'DIFFERS from'} the real one "
          f"({schedule['real_steps']} real / {schedule['simulated_steps']} simulated steps)"
          + ("" if schedule["identical"] else f", first at step {schedule['first_difference']}"))
    print(f"end to end: real {report['real_wall_s']:.2f} s, simulated {report['simulated_s']:.2f} s "
          f"({report['end_to_end_error_pct']:+.1f}%)")
    if report["latencies"]:
        print(f"under Poisson arrivals at {args.arrival_rate} requests/s ({args.arrival_requests} requests), "
              "real vs simulated:")
        for name, row in report["latencies"].items():
            print(f"  {name:9s} {row['real_s'] * 1000:9.1f} ms {row['simulated_s'] * 1000:9.1f} ms "
                  f"({row['error_pct']:+.1f}%)")
    if args.output:
        print(f"wrote the profile to {args.output}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot_held_out(report, args.plot)
        print(f"wrote {args.plot}")
    return 0 if schedule["identical"] else 1


def plot_held_out(report: dict, path: str) -> None:
    """Predicted against measured time of the held-out steps (PNG; needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["held_out_steps"]
    measured, predicted = np.array(steps["measured_s"]) * 1e3, np.array(steps["predicted_s"]) * 1e3
    fig, ax = plt.subplots(figsize=(5.5, 5))
    points = ax.scatter(measured, predicted, c=steps["tokens"], cmap="viridis", s=18)
    fig.colorbar(points, label="tokens in the step")
    low = min(measured.min(), predicted.min()) / 1.2
    top = max(measured.max(), predicted.max()) * 1.2
    ax.plot([low, top], [low, top], color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, top)
    ax.set_ylim(low, top)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    error = report["held_out_step_error"]
    ax.set_title(f"held-out steps on {report['cpu']}: mean error {error['mean_abs_error_pct']:.1f}%", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_step_time_bench_parser(bench_sub) -> None:
    p = bench_sub.add_parser("step-time", help="measure a step-time profile for `pagoda simulate` and check the "
                                               "simulator against the real engine")
    add_engine_args(p)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", default="16-600", help="N, A-B or lognormal:MEDIAN:SIGMA")
    p.add_argument("--output-len", default="8-96", help="N, A-B or lognormal:MEDIAN:SIGMA")
    p.add_argument("--arrival-rate", type=float, default=0.0,
                   help="then also replay a Poisson trace at this rate on the real engine and compare its latencies "
                        "with the simulation's (0: skip)")
    p.add_argument("--arrival-requests", type=int, default=64)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output", default=None, metavar="FILE", help="write the fitted profile (JSON) here")
    p.add_argument("--report", default=None, metavar="FILE", help="write the comparison (JSON) here")
    p.add_argument("--plot", default=None, metavar="FILE", help="predicted vs measured step times (PNG)")
    p.set_defaults(func=run_step_time_bench)
