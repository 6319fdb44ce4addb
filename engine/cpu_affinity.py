"""The CPUs a worker process runs on, and how much of them a cgroup's CPU quota leaves.

With ``OMP_PROC_BIND`` or ``OMP_PLACES`` set (as CPU tuning guides advise), the OpenMP runtime
that torch loads binds the importing thread to the first place the moment torch is imported. In
the engine process that narrows the main thread's mask to one CPU, and a worker started from it
inherited that mask: its OpenMP team was one thread on one CPU (the shared-prefix benchmark ran
1.8x slower on two cores). So Pagoda records the process's CPUs when it is imported
(``pagoda/__init__.py``, before anything of Pagoda's loads torch), the multiprocessing executor
hands them to each worker it starts (:data:`WORKER_CPUS_ENV`; Ray's workers are Ray's), and the
worker takes them before it imports torch, so its own OpenMP runtime binds its threads within
them. The engine's threads keep what they have. Without binding asked for, nothing changes: the
worker inherits the engine's mask, narrowed or not.

Engine-side functions read only the standard library, so importing this module loads nothing.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from pagoda.environment import read

#: The worker's CPUs, as "0-3,8": set by the executor, read by the worker.
WORKER_CPUS_ENV = "PAGODA_WORKER_CPUS"

_recorded: frozenset[int] | None = None


def record_process_cpus() -> None:
    """Records this process's CPUs, once, if torch (and with it OpenMP's binding) is not
    loaded yet."""
    global _recorded
    if _recorded is None and "torch" not in sys.modules and hasattr(os, "sched_getaffinity"):
        _recorded = frozenset(os.sched_getaffinity(0))


def openmp_binds() -> bool:
    """Whether the environment asks OpenMP (GNU's, which torch's CPU build loads) to bind
    threads to places."""
    bind = os.environ.get("OMP_PROC_BIND", "").strip().lower()
    if bind == "false":
        return False
    return bool(bind) or bool(os.environ.get("OMP_PLACES")) or bool(os.environ.get("GOMP_CPU_AFFINITY"))


def online_cpus() -> frozenset[int]:
    """The machine's online CPUs (their numbers need not run from 0)."""
    try:
        with open("/sys/devices/system/cpu/online") as f:
            return parse_cpus(f.read())
    except (OSError, ValueError):
        return frozenset(range(os.cpu_count() or 1))


def worker_cpus(rank: int = 0, ranks_sharing: int = 1) -> frozenset[int] | None:
    """The CPUs a worker should run on; None where it keeps the mask it inherits (no CPU
    affinity on this system, no OpenMP binding asked for, or the mask already right; a rank's
    share is always named, see default_threads in engine/worker/cpu_threads.py).

    Only where OpenMP binding is asked for: otherwise the worker inherits this process's mask,
    as the user left it. Where torch was imported before Pagoda, the mask Pagoda found was
    already narrowed: the worker then gets the machine's online CPUs, of which the kernel keeps
    those the process's cpuset allows (a ``taskset`` around such a script is not seen). With
    ``ranks_sharing`` ranks on the same CPUs (tensor parallelism on the CPU), rank ``rank`` gets
    its own contiguous share of them, so that the ranks' OpenMP threads do not bind to the same
    first places.
    """
    if not hasattr(os, "sched_getaffinity") or not openmp_binds():
        return None
    cpus = usable_cpus()
    if 1 < ranks_sharing <= len(cpus):
        ordered = sorted(cpus)
        return frozenset(ordered[len(ordered) * rank // ranks_sharing:len(ordered) * (rank + 1) // ranks_sharing])
    return None if cpus == frozenset(os.sched_getaffinity(0)) else cpus


def format_cpus(cpus: frozenset[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    parts, ordered = [], sorted(cpus)
    start = previous = ordered[0]
    for cpu in ordered[1:] + [None]:
        if cpu is not None and cpu == previous + 1:
            previous = cpu
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if cpu is not None:
            start = previous = cpu
    return ",".join(parts)


def parse_cpus(text: str) -> frozenset[int]:
    """"0-2,5" -> {0, 1, 2, 5}."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def take_worker_cpus() -> None:
    """In the worker, before torch is imported: runs on the CPUs the executor named, if any.
    A set the kernel refuses (none of them allowed here) leaves the inherited mask."""
    text = read(WORKER_CPUS_ENV)
    if text and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, parse_cpus(text))
        except (OSError, ValueError):
            pass


# -- a cgroup's CPU quota ------------------------------------------------------------------

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


def cgroup_cpu_limit(proc_cgroup: str | Path = "/proc/self/cgroup",
                     root: str | Path = "/sys/fs/cgroup") -> float | None:
    """The CPUs' worth of time this process's cgroup (and its ancestors) allow per period,
    the smallest along the path; None where there is no quota or no cgroup file says."""
    limits = [limit for directory in _cgroup_dirs(Path(proc_cgroup), Path(root))
              if (limit := _quota_of(directory)) is not None]
    return min(limits) if limits else None


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may use: as recorded at import where OpenMP's binding may have
    narrowed the thread's mask since, else its mask."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset(range(os.cpu_count() or 1))
    if openmp_binds():
        return _recorded if _recorded is not None else online_cpus()
    return frozenset(os.sched_getaffinity(0))


def quota_threads(limit: float, sharers: int = 1) -> int:
    """Threads for each of ``sharers`` workers under a CPU quota of ``limit`` CPUs: their share
    of it rounded up (a quota of 1.5 CPUs ran faster with two threads than with one), at least
    one."""
    return max(1, math.ceil(limit / sharers))


def threads_per_sharer(sharers: int) -> int:
    """Threads for each of ``sharers`` workers that share this process's CPUs (data-parallel
    replicas on the CPU, times their tensor-parallel ranks): the CPUs, or the cgroup's CPU quota
    where it is less, divided among them, at least one each."""
    threads = max(1, len(usable_cpus()) // sharers)
    limit = cgroup_cpu_limit()
    return threads if limit is None else min(threads, quota_threads(limit, sharers))
