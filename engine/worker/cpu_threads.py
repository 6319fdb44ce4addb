"""How many threads a worker's CPU kernels run, where ``--num-threads`` does not say.

torch's default is one thread per CPU of the process's affinity mask. A container started with
a CPU quota (``docker run --cpus 2`` on a 64-core host) keeps all 64 in its mask, and 64 OpenMP
threads that spin while they wait then share two CPUs' worth of time: each step stalls whenever
the quota runs out. So the default is capped at the quota of the process's cgroup (CFS bandwidth:
``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1), rounded up:
measured on 2 cores (Intel Xeon with AMX, 2026-12-05, the `shared-prefix` workload in-process,
the worker in a cgroup v1 with a quota), a quota of 1 CPU ran 4.8-4.9 s with one thread and
5.9-7.1 s with two; a quota of 1.5 CPUs 3.9-4.0 s with two threads and 4.9-5.0 s with one.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def _cgroup_dirs(proc_cgroup: Path, root: Path) -> list[Path]:
    """The process's CPU cgroup directories and their ancestors, innermost first: v2's unified
    hierarchy and v1's cpu controller, both where a hybrid system has both (a namespaced "/"
    gives the mount's root alone)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    dirs: list[Path] = []
    for line in lines:
        try:
            _, controllers, path = line.split(":", 2)
        except ValueError:
            continue
        names = controllers.split(",")
        if names == [""]:
            base = root
        elif "cpu" in names:
            base = next((root / name for name in (controllers, "cpu,cpuacct", "cpu") if (root / name).is_dir()),
                        root / "cpu")
        else:
            continue
        directory = base / path.lstrip("/")
        while True:
            dirs.append(directory)
            if directory == base or base not in directory.parents:
                break
            directory = directory.parent
    return dirs


def _quota_of(directory: Path) -> float | None:
    """CPUs' worth of time one cgroup directory allows; None for no limit or no such files."""
    try:
        fields = (directory / "cpu.max").read_text().split()  # v2: "max 100000" or "200000 100000"
        if len(fields) >= 2:
            return None if fields[0] == "max" else int(fields[0]) / int(fields[1])
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())  # v1: -1 for none
        period_us = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def cgroup_cpu_limit(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup") -> float | None:
    """The CPUs' worth of time this process's cgroup (and its ancestors) allow per period,
    the smallest along the path; None where there is no quota or no cgroup file says."""
    limits = [limit for directory in _cgroup_dirs(Path(proc_cgroup), Path(root))
              if (limit := _quota_of(directory)) is not None]
    return min(limits) if limits else None


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
        capped = max(1, math.ceil(limit / ranks))
        if capped < (threads or torch_default):
            return capped, True
    return threads, False
