"""`pagoda bench plugins`: what the plugin hooks cost per step, scheduler only."""

from __future__ import annotations

import argparse
import time

from pagoda.engine.core.kv_cache_manager import KVCacheManager
from pagoda.benchmarks.kv import simulate_step
from pagoda.engine.core.plugin_manager import create_plugin_manager
from pagoda.engine.core.policy import Policy
from pagoda.engine.core.request import Request
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.core.scheduler import Scheduler

_TIMED = ("sort_key", "select_victim", "preemption_mode", "request_finished", "step_finished")


class TimedPolicy(Policy):
    """A Policy that adds up the time spent in each hook call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = dict.fromkeys(_TIMED, 0.0)
        self.calls = dict.fromkeys(_TIMED, 0)
        for name in _TIMED:
            setattr(self, name, self._timed(name, getattr(self, name)))

    def _timed(self, name, method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
        return call


def run_plugins_bench(args: argparse.Namespace) -> int:
    policy = TimedPolicy(create_plugin_manager(), args.scheduling_policy)
    # Enough blocks for every prompt, not for all of the growth: preemptions happen.
    num_blocks = args.num_running * (-(-args.prompt_len // 16)) + args.num_running * args.num_steps // 64
    kv = KVCacheManager(num_blocks, 16, num_cpu_blocks=num_blocks // 4, evictor=policy.make_evictor())
    scheduler = Scheduler(kv, max_num_seqs=args.num_running, max_num_batched_tokens=8192,
                          max_model_len=4096, policy=policy)
    for i in range(args.num_running):
        params = SamplingParams(max_tokens=args.num_steps, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", [1 + (i * 7 + j) % 5000 for j in range(args.prompt_len)], params,
                                      args.num_steps, priority=i % 4))
    total = 0.0
    steps = 0
    while scheduler.has_unfinished_requests() and steps < args.num_steps:
        start = time.perf_counter()
        simulate_step(scheduler)
        total += time.perf_counter() - start
        steps += 1
    hook_seconds = sum(policy.seconds.values())
    print(f"{args.num_running} running requests, {steps} steps, policy {args.scheduling_policy}, "
          f"{scheduler.stats.num_preemptions} preemptions")
    print(f"{'hook':<20}{'calls':>8}{'us/call':>10}{'us/step':>10}")
    for name in _TIMED:
        calls = policy.calls[name]
        per_call = policy.seconds[name] / calls * 1e6 if calls else 0.0
        print(f"{name:<20}{calls:>8}{per_call:>10.1f}{policy.seconds[name] / steps * 1e6:>10.1f}")
    print(f"hooks: {hook_seconds / steps * 1e6:.0f} us per step = {hook_seconds / total:.1%} of "
          f"schedule+update ({total / steps * 1e3:.2f} ms per step)")
    return 0


def add_plugins_bench_parser(bench_sub) -> None:
    p = bench_sub.add_parser("plugins", help="cost of the plugin hooks per step (scheduler only)")
    p.add_argument("--num-running", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--num-steps", type=int, default=300)
    p.add_argument("--scheduling-policy", default="priority")
    p.set_defaults(func=run_plugins_bench)
