"""`pagoda simulate`: traces, step-time models, the simulated engine against the real one,
and the command."""

from __future__ import annotations

import json
from pathlib import Path
import math

import numpy as np
import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.core.kv_sizing import size_kv_cache
from pagoda.engine.core.plugin_manager import create_plugin_manager
from pagoda.engine.core.policy import Policy
from pagoda.plugins import hookimpl
from pagoda.simulator.model_shapes import load_model_shape
from pagoda.simulator.report import SLO, summarize
from pagoda.simulator.simulator import Simulation
from pagoda.simulator.step_time import (DEVICES, FittedProfile, Roofline, StepShape, fit_profile, load_step_time)
from pagoda.simulator.trace import (TraceError, TraceRequest, load_trace, prompt_token_ids, save_trace,
                                    synthetic_trace)

LLAMA_8B = load_model_shape("llama-3-8b")


# -- traces -----------------------------------------------------------------------------


def test_jsonl_trace_round_trips_and_sorts_by_arrival(tmp_path):
    trace = [TraceRequest(1.5, 10, 3, prefix_group="a", prefix_len=4, priority=2, client="x"),
             TraceRequest(0.25, 7, 1)]
    path = tmp_path / "t.jsonl"
    save_trace(trace, path)
    loaded = load_trace(path)
    assert [r.arrival for r in loaded] == [0.0, 1.25]  # from the first request on
    assert loaded[1] == TraceRequest(1.25, 10, 3, prefix_group="a", prefix_len=4, priority=2, client="x")
    assert load_trace(path, limit=1) == [TraceRequest(0.0, 7, 1)]


def test_null_optional_fields_read_as_absent(tmp_path):
    # NOTE: pandas' to_json and most loggers write null for a field a row lacks.
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival": 0, "prompt_len": 5, "output_len": 2, "prefix_group": null, "prefix_len": null, '
                    '"priority": null, "client": null, "kv_retention": null}\n')
    assert load_trace(path) == [TraceRequest(0.0, 5, 2)]


@pytest.mark.parametrize("line, message", [
    ('{"arrival": 0, "prompt_len": 5}', "missing ['output_len']"),
    ('{"arrival": -1, "prompt_len": 5, "output_len": 2}', "arrival must be"),
    ('{"arrival": 0, "prompt_len": 0, "output_len": 2}', "prompt_len must be an integer >= 1"),
    ('{"arrival": 0, "prompt_len": 5, "output_len": 2, "tokens": 3}', "unknown field(s) ['tokens']"),
    ("not json", "not JSON"),
])
def test_a_bad_jsonl_line_is_named_with_its_number(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival": 0, "prompt_len": 5, "output_len": 2}\n' + line + "\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:2: ") as info:
        load_trace(path)
    assert message in str(info.value)


def test_azure_trace_csv_is_read_as_published(tmp_path):
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n"
                    "2023-11-16 18:15:46,879,0\n")
    trace = load_trace(path)
    assert [(r.prompt_len, r.output_len) for r in trace] == [(879, 1), (374, 44), (396, 109)]
    assert trace[0].arrival == 0
    assert trace[1].arrival == pytest.approx(0.68059)
    assert trace[2].arrival == pytest.approx(4.995169)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,374\n")
    with pytest.raises(TraceError, match=r"csv:2: expected 3 columns"):
        load_trace(path)
    path.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(TraceError, match="TIMESTAMP, ContextTokens, GeneratedTokens"):
        load_trace(path)


def test_synthetic_trace_has_its_rate_lengths_and_groups():
    trace = synthetic_trace(4000, 50.0, "100-200", "7", prefix_groups=3, prefix_len=64, prefix_fraction=0.5,
                            priorities=3, clients=2, seed=1)
    arrivals = np.array([r.arrival for r in trace])
    assert np.all(np.diff(arrivals) >= 0)
    assert 4000 / arrivals[-1] == pytest.approx(50, rel=0.1)
    assert all(100 <= r.prompt_len <= 200 and r.output_len == 7 for r in trace)
    grouped = [r for r in trace if r.prefix_group is not None]
    assert 0.45 < len(grouped) / len(trace) < 0.55
    assert {r.prefix_group for r in grouped} == {"group-0", "group-1", "group-2"}
    assert {r.priority for r in trace} == {0, 1, 2} and {r.client for r in trace} == {"client-0", "client-1"}
    gamma = synthetic_trace(4000, 50.0, "10", "10", arrival="gamma", burstiness=3.0, seed=1)
    gaps = np.diff([r.arrival for r in gamma])
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.25)
    with pytest.raises(ValueError, match="length 'x-1'"):
        synthetic_trace(10, 1.0, "x-1")


def test_prompts_share_exactly_their_groups_prefix():
    a = prompt_token_ids(TraceRequest(0, 50, 1, "g", 32), 0, 1000)
    b = prompt_token_ids(TraceRequest(0, 40, 1, "g", 32), 1, 1000)
    c = prompt_token_ids(TraceRequest(0, 50, 1, "h", 32), 2, 1000)
    lone = [prompt_token_ids(TraceRequest(0, 20, 1), i, 1000) for i in range(3000)]
    assert len(a) == 50 and len(b) == 40 and a[:32] == b[:32] and a[32] != b[32]
    assert c[:3] != a[:3]
    assert len({tuple(p[:2]) for p in lone}) == 3000  # never the same first block
    assert max(max(p) for p in [a, b, c, *lone]) < 1000


# -- step-time models -------------------------------------------------------------------------


def test_roofline_decode_is_bound_by_the_weights_and_prefill_by_flops():
    h200 = Roofline(DEVICES["h200"], LLAMA_8B)
    h100 = Roofline(DEVICES["h100"], LLAMA_8B)
    one = StepShape(num_tokens=1, num_requests=1, num_sampled=1, attention_pairs=512, kv_tokens=512)
    weights = (8.03e9 - 128256 * 4096) * 2  # the input embedding is gathered, not read
    assert h200.weight_bytes == pytest.approx(weights, rel=0.01)
    assert h200.weight_memory_bytes == pytest.approx(8.03e9 * 2, rel=0.01)
    device = DEVICES["h200"]
    assert h200.step_seconds(one) == pytest.approx(
        device.step_overhead_s + weights / (device.bandwidth * device.bandwidth_efficiency), rel=0.02)
    assert h100.step_seconds(one) > h200.step_seconds(one)  # less bandwidth
    prefill = StepShape(num_tokens=8192, num_requests=4, num_sampled=4, attention_pairs=4 * 2048 * 2049 // 2,
                        kv_tokens=8192)
    flops = 2 * 8192 * (8.03e9 - 128256 * 4096 * 2)
    assert h200.step_seconds(prefill) > flops / (device.flops * device.matmul_efficiency)
    assert h100.step_seconds(prefill) == pytest.approx(h200.step_seconds(prefill), rel=0.02)  # same FLOPs
    tp2 = Roofline(DEVICES["h200"], LLAMA_8B, tensor_parallel_size=2)
    assert tp2.step_seconds(prefill) < 0.6 * h200.step_seconds(prefill)


def test_roofline_sizes_the_kv_cache_from_device_memory():
    h200 = Roofline(DEVICES["h200"], LLAMA_8B)
    assert h200.kv_cache_bytes(0.9) == pytest.approx(141e9 * 0.9 - 16.06e9 - 2e9, rel=0.01)
    with pytest.raises(ValueError, match="do not fit in 90% of a L4"):
        Roofline(DEVICES["l4"], load_model_shape("llama-3-70b")).kv_cache_bytes(0.9)
    assert Roofline(DEVICES["l4"], load_model_shape("llama-3-70b"), tensor_parallel_size=8).kv_cache_bytes(0.9) > 0


def test_fit_recovers_a_linear_step_time_and_drops_negative_terms():
    rng = np.random.default_rng(0)
    shapes = [StepShape(int(t), int(r), int(r), int(p), int(k))
              for t, r, p, k in rng.integers(1, 4000, size=(60, 4))]
    truth = {"step": 5e-3, "token": 2e-4, "attention_pair": 1e-8, "kv_token": 3e-7}
    seconds = [truth["step"] + truth["token"] * s.num_tokens + truth["attention_pair"] * s.attention_pairs
               + truth["kv_token"] * s.kv_tokens for s in shapes]
    coefficients, error = fit_profile(shapes, seconds)
    assert error < 1e-6
    for term, value in truth.items():
        assert coefficients[term] == pytest.approx(value, rel=1e-4)
    assert coefficients["request"] == pytest.approx(0, abs=1e-9) and coefficients["swapped_block"] == 0
    assert all(v >= 0 for v in coefficients.values())


def test_a_profile_file_round_trips_and_refuses_another_model(tmp_path):
    profile = FittedProfile({"step": 0.01, "token": 1e-4}, engine_overhead_s=1e-3, device="cpu x",
                            model={"layers": 2})
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = FittedProfile.load(path)
    assert loaded.step_seconds(StepShape(num_tokens=100)) == pytest.approx(0.02)
    assert loaded.engine_overhead_s == 1e-3
    with pytest.raises(ValueError, match="measured with a model of shape"):
        load_step_time(str(path), LLAMA_8B, 16)
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        load_step_time("tpu", LLAMA_8B, 16)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a step-time profile"):
        FittedProfile.load(tmp_path / "bad.json")


# -- the simulated engine ---------------------------------------------------------------------


def _simulate(trace, policy="fcfs", eviction="lru", device="h200", record_steps=False, plugins=(), read_gbps=0.5,
              **overrides):
    values = dict(kv_cache_bytes=2 * 1024**3, max_num_batched_tokens=8192, async_scheduling=True,
                  scheduling_policy=policy, eviction_policy=eviction, plugins=tuple(plugins))
    values.update(overrides)
    config = EngineConfig(**values)
    kv = size_kv_cache(config, LLAMA_8B, 2)
    step_time = load_step_time(device, LLAMA_8B, config.block_size)
    sim = Simulation(config, kv, step_time, lambda: Policy(create_plugin_manager(config.plugins), policy, eviction),
                     LLAMA_8B.vocab_size, record_steps=record_steps, kv_offload_read_bytes_per_s=read_gbps * 1e9)
    return sim, sim.run(trace, progress=False)


def test_every_request_finishes_with_its_length_and_no_block_leaks():
    trace = synthetic_trace(300, 40.0, "lognormal:400:0.8", "lognormal:60:0.8", prefix_groups=4, prefix_len=256,
                            prefix_fraction=0.6, seed=3)
    sim, result = _simulate(trace, kv_cache_bytes=int(0.5 * 1024**3))
    max_len = sim.kv.max_model_len
    expected = [0 if r.prompt_len >= max_len else min(r.output_len, max_len - r.prompt_len) for r in trace]
    assert result.num_output.tolist() == expected
    ran = ~result.rejected
    assert result.rejected.tolist() == [r.prompt_len >= max_len for r in trace]
    assert np.all(result.first_token[ran] >= result.arrival[ran]) and np.all(result.finish[ran] >= result.first_token[ran])
    manager = sim.replicas[0].scheduler.kv_cache_manager
    assert manager.get_num_free_blocks() == manager.num_blocks
    summary = summarize(result, SLO.parse("ttft=1,tpot=50ms"))
    assert summary["finished"] == ran.sum() and summary["prefix_cache_hit_rate"] > 0.1
    assert summary["preemptions"] > 0  # half a GiB is tight for this load
    assert 0 < summary["slo_attainment"] <= 1


def test_priority_policy_serves_urgent_requests_first_under_overload():
    trace = synthetic_trace(600, 60.0, "lognormal:1500:0.5", "lognormal:200:0.5", priorities=2, seed=4)
    urgent = np.array([r.priority == 0 for r in trace])
    ttft, summaries = {}, {}
    for policy in ("fcfs", "priority"):
        _, result = _simulate(trace, policy, device="l4", kv_cache_bytes=4 * 1024**3)
        ttft[policy] = np.median(result.first_token[urgent] - result.arrival[urgent])
        summaries[policy] = summarize(result, SLO())["by_priority"]
    assert ttft["priority"] < 0.5 * ttft["fcfs"]
    assert summaries["priority"]["0"]["ttft_s"]["p50"] == pytest.approx(ttft["priority"])
    assert summaries["priority"]["1"]["ttft_s"]["p50"] > summaries["priority"]["0"]["ttft_s"]["p50"]


def test_data_parallel_replicas_share_the_load_through_the_engines_router():
    trace = synthetic_trace(400, 80.0, "300", "50", prefix_groups=8, prefix_len=256, prefix_fraction=1.0, seed=5)
    sim, result = _simulate(trace, data_parallel_size=2)
    assert sim.router.stats.num_routed == 400
    assert min(sim.router.stats.per_replica) > 100
    assert sim.router.stats.num_by_prefix > 200  # groups stick to the replica holding their prefix
    assert not np.isnan(result.finish).any()


def test_a_disk_tier_serves_the_prefixes_the_pool_evicts_where_reading_beats_computing():
    # 200 system prompts of 2,000 tokens by Zipf popularity: 26 GB of KV over a 4 GiB pool.
    trace = synthetic_trace(800, 20.0, "2100", "32", prefix_groups=200, prefix_len=2000, prefix_fraction=1.0,
                            prefix_zipf=1.0, seed=6)
    results = {}
    for name, tier, device, read_gbps in (("off", None, "l4", 1), ("disk", 64, "l4", 2), ("slow disk", 64, "h200", 0.5),
                                          ("host", 64, "h200", 50)):
        values = dict(kv_cache_bytes=4 * 1024**3, device=device)
        if tier:
            values.update(kv_offload_host_bytes=tier * 1024**3)
        config_sim, result = _simulate(trace, **values, read_gbps=read_gbps)
        manager = config_sim.replicas[0].scheduler.kv_cache_manager
        assert manager.get_num_free_blocks() == manager.num_blocks
        results[name] = summarize(result, SLO())
    off, disk = results["off"], results["disk"]
    assert off["disk_tier_hit_rate"] == 0 and disk["disk_tier_hit_rate"] > 0.2
    assert disk["prefix_cache_hit_rate"] > off["prefix_cache_hit_rate"] + 0.2
    # On an L4 a 2,000-token prefill costs more than reading its blocks at 2 GB/s: the tier pays.
    assert disk["ttft_s"]["p50"] < off["ttft_s"]["p50"]
    # An H200 computes a block faster than 0.5 GB/s reads it: the engine measures both and computes;
    # from host memory at 50 GB/s it reads.
    assert results["slow disk"]["disk_tier_hit_rate"] < 0.05 < 0.2 < results["host"]["disk_tier_hit_rate"]


class RoundRobin:
    """A routing plugin: each request to the next replica, whatever their caches hold."""

    def __init__(self) -> None:
        self.count = 0

    @hookimpl
    def pagoda_route_request(self, prompt_token_ids, replicas):
        self.count += 1
        return replicas[self.count % len(replicas)].index


ROUND_ROBIN = RoundRobin()


@pytest.mark.parametrize("replicas", [2, 4])
def test_the_router_keeps_prefixes_where_they_are_cached_and_the_load_even(replicas):
    """Cache-aware routing against round-robin (a plugin through pagoda_route_request), same trace."""
    trace = synthetic_trace(1200, 120.0, "1200", "40", prefix_groups=48, prefix_len=1024, prefix_fraction=1.0,
                            prefix_zipf=0.8, seed=7)
    runs = {}
    for name, plugins in (("cache-aware", ()), ("round-robin", ("test_simulator:ROUND_ROBIN",))):
        sim, result = _simulate(trace, kv_cache_bytes=2 * 1024**3, data_parallel_size=replicas, plugins=plugins)
        runs[name] = (sim.router.stats, summarize(result, SLO()))
    aware, rr = runs["cache-aware"], runs["round-robin"]
    assert rr[0].num_by_plugin == 1200 and aware[0].num_by_plugin == 0
    assert aware[1]["prefix_cache_hit_rate"] > rr[1]["prefix_cache_hit_rate"] + 0.1
    assert aware[1]["ttft_s"]["p50"] < rr[1]["ttft_s"]["p50"]
    # Balanced within a quarter of an even share, as round-robin is by construction.
    share = 1200 / replicas
    assert max(abs(n - share) for n in aware[0].per_replica) < 0.25 * share
    assert max(abs(n - share) for n in rr[0].per_replica) <= 1


def test_one_request_longer_than_the_context_is_rejected_not_run():
    trace = [TraceRequest(0, 9000, 5), TraceRequest(0, 100, 5)]
    _, result = _simulate(trace)
    assert result.rejected.tolist() == [True, False]
    assert result.num_output.tolist() == [0, 5]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_simulated_schedule_equals_the_real_engines(tiny_llama_dir, tmp_path, async_scheduling):
    """The fidelity check: the same trace through the real engine (a worker process and a
    model) and through the simulator gives the same steps, request by request, token by
    token; preemption and prefix-cache hits included."""
    from pagoda.benchmarks.step_time import measure, plot_held_out

    trace = synthetic_trace(14, math.inf, "8-90", "4-40", prefix_groups=2, prefix_len=32, prefix_fraction=0.5, seed=7)
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True, num_kv_blocks=24,
                          block_size=8, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=8,
                          async_scheduling=async_scheduling, preemption_mode="recompute")
    arrivals = synthetic_trace(10, 40.0, "8-60", "4-24", seed=8) if not async_scheduling else None
    report = measure(config, trace, arrivals)
    schedule = report["schedule"]
    assert schedule["identical"], schedule
    assert schedule["real_steps"] > 20
    assert report["preemptions"] > 0 and report["prefix_cache_hit_rate"] > 0
    profile = report["profile"]
    decode = StepShape(num_tokens=1, num_requests=1, num_sampled=1, attention_pairs=40, kv_tokens=40)
    assert profile.step_seconds(decode) > 0 and profile.fit["steps"] == report["steps"]
    if arrivals is not None:
        # latencies under arrivals over time, real and simulated with the profile fitted
        # above (their agreement is measured on the real model: docs/simulate.md; a tiny
        # model's few-ms steps on a shared machine say little about it)
        rows = report["latencies"]
        assert set(rows) == {f"{m}_p{q}" for m in ("ttft", "tpot", "e2e") for q in (50, 90)}
        assert all(row["real_s"] > 0 and row["simulated_s"] > 0 for row in rows.values()), rows
    plot_held_out(report, tmp_path / "held_out.png")
    assert (tmp_path / "held_out.png").read_bytes()[:4] == b"\x89PNG"


# -- the command ---------------------------------------------------------------------------------


def test_the_docs_first_example_at_reduced_size_tells_the_policies_apart(tmp_path, capsys):
    # NOTE: docs/simulate.md's first command with 1,000 requests instead of 2,000: the H200 is
    # still past its capacity at 40 a second, so the three policies' rows differ.
    from pagoda.cli.main import main

    doc = (Path(__file__).parent.parent / "docs" / "simulate.md").read_text()
    command = doc.split("```bash\n", 1)[1].split("```", 1)[0].split("\n", 1)[1].replace("\\\n", " ").split()
    assert command[:2] == ["pagoda", "simulate"] and "--num-requests" in command
    args = command[2:]
    args[args.index("--num-requests") + 1] = "1000"
    out = tmp_path / "result.json"
    args[args.index("--output") + 1] = str(out)
    plot = args.index("--plot")  # NOTE: left out: the plots need matplotlib, tested below
    assert main(["simulate", *args[:plot], *args[plot + 2:], "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "rejected: prompt and output over max_model_len" in printed
    runs = {r["scheduling_policy"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"fcfs", "priority", "shortest-prompt-first"}
    p50 = {name: run["ttft_s"]["p50"] for name, run in runs.items()}
    assert p50["priority"] < p50["fcfs"] / 3 and p50["shortest-prompt-first"] < p50["fcfs"] / 3, p50
    attained = {name: run["slo_attainment"] for name, run in runs.items()}
    assert attained["fcfs"] < attained["priority"] and attained["fcfs"] < attained["shortest-prompt-first"], attained


def test_simulate_command_compares_policies_and_writes_json_and_plots(tmp_path, capsys):
    from pagoda.cli.main import main

    trace = tmp_path / "trace.jsonl"
    out = tmp_path / "result.json"
    rc = main(["simulate", "--model", "llama-3-8b", "--device", "a100", "--num-requests", "200",
               "--request-rate", "20", "--priorities", "2", "--scheduling-policy", "fcfs,priority",
               "--eviction-policy", "lru,retention-priority", "--slo", "ttft=0.5,tpot=50ms", "--save-trace",
               str(trace), "--output", str(out), "--plot", str(tmp_path / "plots"), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| fcfs | lru |" in text and "| priority | retention-priority |" in text
    data = json.loads(out.read_text())
    assert [(r["scheduling_policy"], r["eviction_policy"]) for r in data["runs"]] == [
        ("fcfs", "lru"), ("fcfs", "retention-priority"), ("priority", "lru"), ("priority", "retention-priority")]
    run = data["runs"][0]
    assert run["finished"] + run["rejected_too_long"] == 200 and run["finished"] > 190 and run["ttft_s"]["p50"] > 0 and len(run["time_series"]["kv_usage"]) > 10
    assert len(load_trace(trace)) == 200
    for name in ("latency_cdf.png", "kv_usage.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same trace file gives the same result; at four times the rate, longer queues
    assert main(["simulate", "--device", "a100", "--trace", str(trace), "--priorities", "2", "--output",
                 str(tmp_path / "again.json"), "--no-progress"]) == 0
    again = json.loads((tmp_path / "again.json").read_text())["runs"][0]
    assert again["ttft_s"] == run["ttft_s"]
    assert main(["simulate", "--device", "a100", "--trace", str(trace), "--time-scale", "0.25", "--output",
                 str(tmp_path / "faster.json"), "--no-progress"]) == 0
    faster = json.loads((tmp_path / "faster.json").read_text())["runs"][0]
    assert faster["ttft_s"]["p50"] > run["ttft_s"]["p50"] and faster["queue_max"] > run["queue_max"]


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu9"], "unknown device 'tpu9'"),
    (["--model", "no-such-model"], "model 'no-such-model'"),
    (["--scheduling-policy", "fcfs,lifo"], "unknown scheduling policy 'lifo'"),
    (["--slo", "ttft=fast"], "not a number of seconds"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--time-scale", "0"], "--time-scale must be > 0"),
    (["--arrival", "gamma", "--burstiness", "0"], "burstiness must be > 0"),
    (["--output", "/nonexistent/dir/r.json"], "its folder does not exist"),
    (["--trace", "/nonexistent.jsonl"], "does not exist"),
    (["--model", "smollm2-135m", "--device", "h100", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
])
def test_simulate_command_errors_are_clear(capsys, argv, message):
    from pagoda.cli.main import main

    assert main(["simulate", "--num-requests", "5", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_simulate_on_this_cpu_and_on_a_measured_profile(tmp_path, capsys):
    """`--device cpu` probes this machine; a profile file carries the measured engine's
    settings (budget, async scheduling) and its model's shape."""
    from pagoda.cli.main import main
    from pagoda.simulator.step_time import model_summary, probe_cpu

    spec = probe_cpu(seconds=0.1)
    assert spec.flops > 1e9 and spec.bandwidth > 1e9
    model = load_model_shape("smollm2-135m")
    FittedProfile({"step": 0.01, "token": 2e-4, "kv_token": 1e-7}, model=model_summary(model),
                  fit={"async_scheduling": False, "max_num_batched_tokens": 512}).save(tmp_path / "p.json")
    for device in ("cpu", str(tmp_path / "p.json")):
        out = tmp_path / "r.json"
        assert main(["simulate", "--model", "smollm2-135m", "--device", device, "--num-requests", "40",
                     "--request-rate", "4", "--no-progress", "--output", str(out)]) == 0
        text = capsys.readouterr().out
        assert "async scheduling off" in text
        data = json.loads(out.read_text())
        assert data["runs"][0]["finished"] + data["runs"][0]["rejected_too_long"] == 40
        assert data["max_num_batched_tokens"] == (2048 if device == "cpu" else 512)
