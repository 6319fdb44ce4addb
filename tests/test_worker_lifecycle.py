"""The worker starts from any kind of script, and a worker that cannot start says why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda import LLM
from pagoda.engine.exceptions import WorkerDiedError

pytestmark = pytest.mark.slow  # NOTE: `python -m pytest -m slow` runs it (CI runs both sets)

SCRIPT = """\
from pagoda import LLM, SamplingParams

llm = LLM({model!r}, enforce_eager=True, dtype="float32", max_model_len=64, num_kv_blocks=32)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
print("TOKENS", out[0].outputs[0].token_ids)
"""


def run_python(args: list[str], stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=180,
                          cwd=cwd)


def tokens_printed(result: subprocess.CompletedProcess) -> list[int]:
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("TOKENS"))
    return eval(line.removeprefix("TOKENS"))  # noqa: S307 - a list literal we printed


def test_script_without_main_guard_and_script_on_stdin_both_generate(tiny_llama_dir, tmp_path):
    script = SCRIPT.format(model=str(tiny_llama_dir))
    path = tmp_path / "unguarded.py"
    path.write_text(script)
    from_file = tokens_printed(run_python([str(path)], cwd=tmp_path))
    from_stdin = tokens_printed(run_python(["-"], stdin=script, cwd=tmp_path))
    assert len(from_file) == 4
    assert from_file == from_stdin


def test_a_worker_that_fails_to_start_reports_its_traceback(tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in tiny_llama_dir.iterdir():
        target = broken / file.name
        target.write_bytes(b"not a safetensors file" if file.suffix == ".safetensors" else file.read_bytes())
    with pytest.raises(WorkerDiedError) as info:
        LLM(str(broken), enforce_eager=True, dtype="float32", max_model_len=64, num_kv_blocks=32)
    message = str(info.value)
    assert "failed to start" in message and "Traceback" in message
    assert "safetensors" in message.lower()


@pytest.mark.parametrize("user_value", [None, "glibc.malloc.arena_max=2"])
def test_the_worker_gets_the_allocator_tunables_unless_the_user_set_some(tiny_llama_dir, monkeypatch, user_value):
    if user_value is not None:
        monkeypatch.setenv("GLIBC_TUNABLES", user_value)
    with LLM(str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=128) as llm:
        environ = Path(f"/proc/{llm.engine.worker.pid}/environ").read_bytes().split(b"\0")
    tunables = [e.decode() for e in environ if e.startswith(b"GLIBC_TUNABLES=")]
    assert len(tunables) == 1
    if user_value is None:
        assert "glibc.malloc.mmap_threshold=67108864" in tunables[0]
    else:
        assert tunables[0] == f"GLIBC_TUNABLES={user_value}"


# -- the worker's CPUs ----------------------------------------------------------------------

AFFINITY_SCRIPT = """\
import os
{before}
from pagoda import LLM
{after}

llm = LLM({model!r}, enforce_eager=True, dtype="float32", max_model_len=64, num_kv_blocks=32)
tasks = f"/proc/{{llm.engine.worker.pid}}/task"
cpus = set()
for task in os.listdir(tasks):
    for line in open(f"{{tasks}}/{{task}}/status"):
        if line.startswith("Cpus_allowed_list:"):
            for part in line.split(":")[1].strip().split(","):
                low, _, high = part.partition("-")
                cpus.update(range(int(low), int(high or low) + 1))
print("WORKER", sorted(cpus))
llm.shutdown()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell one from all")
@pytest.mark.parametrize("case", ["openmp-binds", "openmp-binds-torch-first", "taskset-one-cpu",
                                  "narrowed-after-import"])
def test_the_worker_runs_on_the_processs_cpus_whatever_openmp_bound(tiny_llama_dir, tmp_path, case):
    """With OMP_PROC_BIND set, torch's OpenMP binds the engine's thread to one CPU on import;
    the worker used to inherit that one CPU (and ran on one thread). Its threads now span the
    CPUs the process had, or, where the user narrowed them (before or after importing Pagoda,
    OpenMP not binding), only those."""
    from pagoda.engine.cpu_affinity import online_cpus

    mine = os.sched_getaffinity(0)
    if case == "openmp-binds-torch-first" and mine != online_cpus():
        pytest.skip("the worker asks for every online CPU there; this process has fewer")
    narrow = "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})"
    before, after = {"openmp-binds": ("", ""), "openmp-binds-torch-first": ("import torch", ""),
                     "taskset-one-cpu": (narrow, ""), "narrowed-after-import": ("import pagoda", narrow)}[case]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")}
    env["OMP_NUM_THREADS"] = str(len(mine))  # one bound thread a CPU, whatever torch's default
    if case.startswith("openmp-binds"):
        env["OMP_PROC_BIND"] = "close"
    script = AFFINITY_SCRIPT.format(before=before, after=after, model=str(tiny_llama_dir))
    result = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=180,
                            cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("WORKER"))
    worker = set(eval(line.removeprefix("WORKER")))  # noqa: S307 - a list literal we printed
    assert worker == ({min(mine)} if case in ("taskset-one-cpu", "narrowed-after-import") else mine)


def test_tensor_parallel_ranks_get_their_own_share_of_the_cpus_when_openmp_binds(monkeypatch):
    from pagoda.engine import cpu_affinity

    def share(rank: int, ranks: int) -> frozenset[int]:  # None: the mask the worker inherits
        return cpu_affinity.worker_cpus(rank, ranks) or frozenset(os.sched_getaffinity(0))

    monkeypatch.setattr(cpu_affinity, "_recorded", frozenset({0, 1, 2, 3, 4}))
    for name in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"):
        monkeypatch.delenv(name, raising=False)
    assert cpu_affinity.worker_cpus(1, 2) is None  # unbound: the ranks inherit the engine's CPUs
    monkeypatch.setenv("OMP_PLACES", "cores")
    assert [share(rank, 2) for rank in range(2)] == [frozenset({0, 1}), frozenset({2, 3, 4})]
    assert share(0, 1) == frozenset({0, 1, 2, 3, 4})


def test_cpu_lists_read_back_as_written():
    from pagoda.engine.cpu_affinity import format_cpus, parse_cpus

    for cpus in ({0}, {0, 1}, {0, 1, 2, 5}, {3, 7, 8, 9, 12}):
        assert parse_cpus(format_cpus(frozenset(cpus))) == cpus
    assert format_cpus(frozenset({0, 1, 2, 5})) == "0-2,5"


# -- the worker's threads under a container's CPU quota -------------------------------------

def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize("proc_cgroup,files,expected", [
    # cgroup v2, the process's own group limited
    ("0::/docker/abc\n", {"docker/abc/cpu.max": "200000 100000\n", "cpu.max": "max 100000\n"}, 2.0),
    # v2, a parent's limit is the tighter one
    ("0::/a/b\n", {"a/b/cpu.max": "max 100000\n", "a/cpu.max": "150000 100000\n"}, 1.5),
    # v2 inside a namespace: the group is "/", its files at the root
    ("0::/\n", {"cpu.max": "50000 100000\n"}, 0.5),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    # v1, the cpu controller mounted with cpuacct
    ("4:memory:/x\n3:cpu,cpuacct:/x\n", {"cpu,cpuacct/x/cpu.cfs_quota_us": "300000\n",
                                            "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"}, 3.0),
    ("1:cpu:/x\n", {"cpu/x/cpu.cfs_quota_us": "-1\n", "cpu/x/cpu.cfs_period_us": "100000\n"}, None),
    ("1:cpu:/x\n", {}, None),  # no files: nothing known
    # hybrid: v2's line first, its hierarchy without the cpu controller, v1's cpu limited
    ("0::/\n1:cpu:/x\n", {"cpu/x/cpu.cfs_quota_us": "100000\n", "cpu/x/cpu.cfs_period_us": "100000\n"}, 1.0),
])
def test_the_cgroup_cpu_quota_is_read_from_v1_and_v2_files(tmp_path, proc_cgroup, files, expected):
    from pagoda.engine.cpu_affinity import cgroup_cpu_limit

    write_tree(tmp_path / "fs", files)
    (tmp_path / "fs").mkdir(exist_ok=True)
    (tmp_path / "cgroup").write_text(proc_cgroup)
    assert cgroup_cpu_limit(tmp_path / "cgroup", tmp_path / "fs") == expected
    assert cgroup_cpu_limit(tmp_path / "no-such-file", tmp_path / "fs") is None


def test_the_default_threads_follow_the_quota_and_the_ranks():
    from pagoda.engine.worker.cpu_threads import default_threads

    cpus = len(os.sched_getaffinity(0))
    assert default_threads(1, "cpu", None, cpus) == (None, False)  # torch's default
    assert default_threads(1, "cpu", cpus + 4.0, cpus) == (None, False)  # a quota above it changes nothing
    assert default_threads(1, "cuda", None, cpus) == (None, False)
    assert default_threads(2, "cpu", None, cpus) == (max(1, cpus // 2), False)
    assert default_threads(2, "cpu", None, cpus, own_share=True) == (cpus, False)  # the rank's own CPUs
    assert default_threads(1, "cpu", 0.3, cpus) == (1, True)
    assert default_threads(1, "cpu", 3.0, 4) == (3, True)  # below torch's default of 4
    assert default_threads(1, "cpu", 2.5, 4) == (3, True)  # rounded up
    assert default_threads(1, "cpu", 2.5, 3) == (None, False)  # torch's 3 is no more than the quota allows
    assert default_threads(2, "cpu", 1.0, cpus) == (1, max(1, cpus // 2) > 1)


def quota_cgroup_parent() -> tuple[Path, str] | None:
    """Where this process may make a cgroup with a CPU quota, and the file that takes a
    process into it: v1's cpu controller or v2's root with the cpu controller enabled below it."""
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        return v1, "tasks"
    try:
        if "cpu" in (v2 / "cgroup.subtree_control").read_text().split() and os.access(v2, os.W_OK):
            return v2, "cgroup.procs"
    except OSError:
        pass
    return None


@pytest.mark.skipif(quota_cgroup_parent() is None or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a writable cgroup with the cpu controller (root) and two CPUs")
def test_a_worker_in_a_cgroup_with_a_one_cpu_quota_runs_one_thread(tiny_llama_dir, tmp_path):
    parent, procs = quota_cgroup_parent()
    group = parent / f"pagoda-test-{os.getpid()}"
    group.mkdir()
    try:
        if procs == "tasks":
            (group / "cpu.cfs_quota_us").write_text((group / "cpu.cfs_period_us").read_text())
        else:
            (group / "cpu.max").write_text("100000 100000")
        script = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
                  + SCRIPT.format(model=str(tiny_llama_dir)))
        result = subprocess.run(["bash", "-c", f'echo $$ > {group / procs} && exec "$0" -', sys.executable],
                                input=script, capture_output=True, text=True, timeout=180, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "torch threads: 1 (the cgroup's CPU quota: 1 CPU)" in result.stdout, result.stdout
        assert "worker ready: cpu (1 thread on CPUs " in result.stdout, result.stdout  # what the worker runs
        assert len(tokens_printed(result)) == 4
    finally:
        remove_cgroup(group)


def remove_cgroup(group: Path) -> None:
    """Stops what is left in the group (a worker still exiting, or a timed-out run's), then
    removes it."""
    import signal
    import time
    import warnings

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    try:
        group.rmdir()
    except OSError as error:
        warnings.warn(f"could not remove the test's cgroup {group}: {error}", stacklevel=1)


# -- the KV cache sized from the device's memory (a GPU; simulated here) -----------------

MEMORY_SIZED = dict(enforce_eager=True, dtype="float32", max_model_len=256, gpu_memory_utilization=0.5)


@pytest.fixture
def simulated_device(monkeypatch):
    """A device of 64 MiB, simulated on the CPU: the worker measures its weights, the rest is 0."""
    from pagoda.engine.config import SIMULATED_DEVICE_MEMORY_ENV

    monkeypatch.setenv(SIMULATED_DEVICE_MEMORY_ENV, str(64 << 20))
    return 64 << 20


def test_the_kv_cache_takes_what_the_memory_utilization_leaves_after_the_weights(tiny_llama_dir, simulated_device):
    import os
    import signal

    from pagoda import SamplingParams
    from helpers import make_hf_model

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_llama_dir), **MEMORY_SIZED) as llm:
        engine = llm.engine
        [memory] = engine.device_memory
        hf_bytes = sum(p.nbytes for p in make_hf_model(tiny_llama_dir).parameters())
        assert memory.total == simulated_device and hf_bytes <= memory.weights < hf_bytes + (1 << 20)
        kv = engine.kv_cache_size
        assert kv.num_blocks == (simulated_device // 2 - memory.weights) // kv.bytes_per_block
        assert kv.num_blocks < 256 * 256 // 16  # not the cap of max_num_seqs full requests
        assert engine.worker.ready.kv_cache_bytes == kv.num_bytes
        first = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
        # A restarted worker allocates what the first start decided, without measuring again.
        os.kill(engine.worker.pid, signal.SIGKILL)
        assert llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids == first
        assert engine.core.num_worker_restarts == 1 and engine.kv_cache_size is kv
        assert engine.worker.ready.kv_cache_bytes == kv.num_bytes
    with LLM(str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=256, num_kv_blocks=64) as llm:
        assert llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids == first


def test_a_utilization_that_leaves_nothing_for_the_kv_cache_says_so(tiny_llama_dir, simulated_device):
    with pytest.raises(ValueError, match="leaves nothing for the KV cache: weights"):
        LLM(str(tiny_llama_dir), **{**MEMORY_SIZED, "gpu_memory_utilization": 0.05})


def test_tensor_parallel_ranks_allocate_one_size_from_their_measurements(tiny_llama_dir, simulated_device):
    from pagoda import SamplingParams
    from helpers import make_hf_model

    with LLM(str(tiny_llama_dir), **{**MEMORY_SIZED, "gpu_memory_utilization": 0.25}, tensor_parallel_size=2) as llm:
        memory = llm.engine.device_memory
        whole = sum(p.nbytes for p in make_hf_model(tiny_llama_dir).parameters())
        assert len(memory) == 2 and all(m.weights < whole for m in memory)  # each rank its share
        budget = min(simulated_device // 4 - m.weights for m in memory)
        assert llm.engine.kv_cache_size.num_blocks == budget // llm.engine.kv_cache_size.bytes_per_block
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4


def test_an_explicit_kv_cache_size_is_not_measured(tiny_llama_dir, simulated_device):
    with LLM(str(tiny_llama_dir), **MEMORY_SIZED, kv_cache_bytes=1 << 20) as llm:
        assert llm.engine.device_memory is None
        assert llm.engine.kv_cache_size.num_blocks == (1 << 20) // llm.engine.kv_cache_size.bytes_per_block


def test_a_rank_that_fails_to_start_stops_the_others_instead_of_waiting_for_them():
    """A rank that fails while the others wait for it in a collective (the memory profile's
    all-reduces): the group stops every rank and raises at once, not after the others."""
    import asyncio

    from pagoda.engine.exceptions import WorkerDiedError
    from pagoda.engine.executor.multiproc import WorkerGroup

    group = WorkerGroup.__new__(WorkerGroup)
    stopped = []

    async def shutdown(timeout=5.0):
        stopped.append(timeout)

    group.shutdown = shutdown

    async def failing():
        await asyncio.sleep(0.01)
        raise WorkerDiedError("rank 1 failed to start")

    async def main():
        waiting = asyncio.Event()  # never set: a rank blocked in a collective
        with pytest.raises(WorkerDiedError, match="rank 1"):
            await asyncio.wait_for(group._every_rank([waiting.wait(), failing()]), timeout=10)

    asyncio.run(main())
    assert stopped == [1.0]


def _child_pids() -> set[int]:
    """The pids of this process's living children (from /proc)."""
    me, children = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[1]) == me:
            children.add(int(entry.name))
    return children


def test_a_start_cancelled_while_the_worker_loads_leaves_no_worker(tiny_llama_dir):
    """Ctrl-C during start-up: the engine core does not exist yet, and still the worker stops."""
    import asyncio

    from pagoda.engine.config import EngineConfig
    from pagoda.engine.frontend.async_engine import AsyncEngine

    before = _child_pids()

    async def cancel_while_loading() -> None:
        engine = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32",
                                          max_model_len=64, num_kv_blocks=32))
        start = asyncio.ensure_future(engine.start())
        for _ in range(600):
            if _child_pids() - before:
                break
            await asyncio.sleep(0.01)
        assert _child_pids() - before, "no worker process appeared"
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert engine.core is None

    asyncio.run(cancel_while_loading())
    assert not _child_pids() - before
