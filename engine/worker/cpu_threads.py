"""How many threads a worker's CPU kernels run, where ``--num-threads`` does not say.

torch's default is one thread per CPU of the process's affinity mask. A container started with
a CPU quota (``docker run --cpus 2`` on a 64-core host) keeps all 64 in its mask, and 64 OpenMP
threads that spin while they wait then share two CPUs' worth of time: each step stalls whenever
the quota runs out. So the default is capped at the quota of the process's cgroup (CFS
bandwidth, engine/cpu_affinity.py's cgroup_cpu_limit: ``cpu.max`` in cgroup v2,
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1), rounded up:
measured on 2 cores (Intel Xeon with AMX, 2026-12-05, the `shared-prefix` workload in-process,
the worker in a cgroup v1 with a quota), a quota of 1 CPU ran 4.8-4.9 s with one thread and
5.9-7.1 s with two; a quota of 1.5 CPUs 3.9-4.0 s with two threads and 4.9-5.0 s with one.
"""

from __future__ import annotations

import os

from pagoda.engine.cpu_affinity import quota_threads


def default_threads(world_size: int, device_type: str, limit: float | None, torch_default: int,
                    own_share: bool = False) -> tuple[int | None, bool]:
    """Threads for a worker whose config names none, and whether the cgroup's CPU quota decided
    them: None (torch's default, ``torch_default``) unless the ranks share the CPUs (tensor
    parallelism on the CPU: this process's CPUs / ranks each, or all of them where they are
    the rank's own share, ``own_share``) or the quota (``limit``, cgroup_cpu_limit's) is below
    that: then the quota / ranks, rounded up."""
    ranks = world_size if device_type != "cuda" else 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = None if ranks == 1 else max(1, cpus if own_share else cpus // ranks)
    if limit is not None:
        capped = quota_threads(limit, ranks)
        if capped < (threads or torch_default):
            return capped, True
    return threads, False
