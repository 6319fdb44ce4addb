"""The engine's handle on a worker process: start, send steps, receive results, stop.

The worker is an interpreter of its own (``python -m pagoda.engine.worker.main``) connected by a
socket pair, so starting it never re-imports the user's ``__main__``. A reader thread
receives the worker's messages in order and hands them to the event loop; when the
worker dies its end of the socket closes, which the reader sees at once, so a pending
or later receive raises :class:`WorkerDiedError` instead of hanging.

Several steps may be in flight: ``send`` only queues the message for a writer thread
(a large step must not block the event loop while the worker is busy with the one
before), and results come back in the order the steps were sent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from pagoda.engine.config import compiles_model
from pagoda.engine.cpu_affinity import WORKER_CPUS_ENV, format_cpus, worker_cpus
from pagoda.engine.exceptions import WorkerDiedError
from pagoda.engine.messages import (
    KVCacheAllocation,
    RunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerFailed,
    WorkerInit,
    WorkerMemory,
    WorkerProgress,
    WorkerReady,
)

#: glibc's allocator for the worker, unless GLIBC_TUNABLES is set already: blocks up to 64 MiB
#: from the heap rather than mmap (a step's activations, 1-50 MB each, were mapped and unmapped
#: every step: page faults, unmaps and memory-cgroup charging took about 9% of a prefill's
#: samples), and freed memory kept up to 1 GiB. A 64 x 256-token prefill went 25.9-26.5 ->
#: 22.8-23.3 s for six (Intel Xeon with AMX, alternated twice); decode and a single stream
#: moved within noise. The price is up to 1 GiB of memory that the worker keeps once used.
WORKER_MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=1073741824"

#: torch's allocations of 2 MiB or more on transparent huge pages (madvise), unless the
#: environment sets THP_MEM_ALLOC_ENABLE: a decode reads every weight from memory each step,
#: and over 4 KiB pages (the default where the kernel's THP mode is "madvise") each page costs
#: a TLB miss and stops the prefetchers at its end. A sum over a 1 GiB buffer read 47-51 GB/s on
#: 4 KiB pages, 62-66 on 2 MiB ones; a Qwen3-MoE layer's experts, one token, 695 -> 631 us
#: (AMD EPYC Zen 4, 2026-12-08). The price: an allocation's last huge page may be partly
#: used. Where THP is "never" it changes nothing.
WORKER_HUGE_PAGES = {"THP_MEM_ALLOC_ENABLE": "1"}

if TYPE_CHECKING:
    from pagoda.engine.executor.base import SizeKVCache

_STOP_WRITING = object()
logger = logging.getLogger(__name__)


def describe_exit(returncode: int | None) -> str:
    """'exit code 1' or 'killed by signal 9 (SIGKILL)'."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-returncode} ({name})"
    return f"exit code {returncode}"


class WorkerProcess:
    """One worker process and the socket to it.

    Args:
        init: What the worker loads (sent as its first message).
        env: Extra environment variables for the worker.
        on_death: Called on the event loop when the worker is found dead, so that an
            idle engine notices at once, not at its next step.
    """

    def __init__(self, init: WorkerInit, env: dict[str, str] | None = None,
                 on_death: Callable[[], None] | None = None) -> None:
        self._init = init
        self._env = env or {}
        self._on_death = on_death
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._inbox: asyncio.Queue | None = None
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._death: WorkerDiedError | None = None
        self.ready: WorkerReady | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def death(self) -> WorkerDiedError | None:
        return self._death

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._death is None

    def spawn(self) -> None:
        """Starts the process as a standby: it imports torch and the model's code (at idle
        priority) and waits; :meth:`start` then tells it what to load. A restart that takes
        a standby skips those seconds."""
        self._spawn(standby=True)

    def _spawn(self, standby: bool) -> None:
        from pagoda.engine.model_loader import default_cache_dir
        from pagoda.engine.platform import resolve_device

        env = {"GLIBC_TUNABLES": WORKER_MALLOC_TUNABLES, **WORKER_HUGE_PAGES, **os.environ, **self._env}
        init = self._init
        device_type = resolve_device(init.config.device).type
        cpus = worker_cpus(init.rank, init.world_size if device_type == "cpu" else 1)
        if cpus is not None:
            env[WORKER_CPUS_ENV] = format_cpus(cpus)
        else:
            env.pop(WORKER_CPUS_ENV, None)
        # NOTE: inductor's code beside Pagoda's compiled regions, not in /tmp: they name its
        # libraries, and rebuilding them after /tmp was cleared took 7 s of a (re)start. Where
        # that directory cannot be made (a read-only home), inductor keeps its default.
        inductor = default_cache_dir() / "inductor"
        try:
            inductor.mkdir(parents=True, exist_ok=True)
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor))
        except OSError:
            pass
        compiles = compiles_model(init.config, device_type, init.world_size, init.plan.batch_invariant)
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pagoda.engine.worker.main", "--fd", str(theirs.fileno()),
                 *(["--standby"] if standby else []), *(["--preload-compiler"] if standby and compiles else [])],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        finally:
            # NOTE: closing our copy of the worker's end is what makes its death show up
            # as end-of-file on our end.
            theirs.close()
        self._conn = Connection(ours.detach())

    async def start(self, size_kv: SizeKVCache | None = None) -> WorkerReady:
        """Starts the worker (or takes the standby :meth:`spawn` started) and waits until it
        has loaded the model and allocated the KV cache (sized by ``size_kv`` from what the
        worker measured, where its init leaves num_blocks to it).

        Raises:
            WorkerDiedError: The worker failed to start; the message holds its traceback.
        """
        message = await self.load()
        if isinstance(message, WorkerMemory):
            try:
                allocation = size_kv([message.memory])
            except BaseException:
                await self.shutdown(timeout=1.0)
                raise
            message = await self.allocate(allocation)
        return message

    async def load(self) -> WorkerReady | WorkerMemory:
        """The first half of :meth:`start`: the worker's answer once it has loaded the model
        (WorkerMemory where it waits for an allocation)."""
        if self._proc is None:
            self._spawn(standby=False)
        loop = asyncio.get_running_loop()
        self._inbox = asyncio.Queue()
        self._reader = threading.Thread(target=self._read, args=(loop,), name="pagoda-worker-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="pagoda-worker-writer", daemon=True)
        self._writer.start()
        self._send(self._init)
        return await self._started()

    async def allocate(self, allocation: KVCacheAllocation) -> WorkerReady:
        """The second half of :meth:`start`, after a WorkerMemory: the KV cache to allocate."""
        self._send(allocation)
        message = await self._started()
        assert isinstance(message, WorkerReady), f"unexpected message {type(message).__name__}"
        return message

    async def _started(self) -> WorkerReady | WorkerMemory:
        message = await self.recv()
        while isinstance(message, WorkerProgress):
            logger.info("worker: %s", message.message)
            message = await self.recv()
        if isinstance(message, WorkerFailed):
            await self.shutdown()
            raise WorkerDiedError(f"the worker failed to start:\n{message.error}")
        assert isinstance(message, (WorkerReady, WorkerMemory)), f"unexpected message {type(message).__name__}"
        if isinstance(message, WorkerReady):
            self.ready = message
        return message

    def check(self) -> None:
        """Raises WorkerDiedError if the worker is known to be dead."""
        if self._death is not None:
            raise self._death

    def send(self, scheduler_output: SchedulerOutput) -> None:
        """Sends one step without waiting for it (results come back in order)."""
        self._send(scheduler_output)

    async def recv(self):
        """The worker's next message.

        Raises:
            WorkerDiedError: The worker is gone.
        """
        if self._inbox is None:
            raise WorkerDiedError("the worker is not running")
        if self._death is not None and self._inbox.empty():
            raise self._death
        message = await self._inbox.get()
        if isinstance(message, WorkerDiedError):
            self._inbox.put_nowait(message)  # every later receive fails the same way
            raise message
        return message

    async def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Sends one step and awaits its result (nothing else may be in flight)."""
        self.send(scheduler_output)
        message = await self.recv()
        assert isinstance(message, RunnerOutput), f"unexpected message {type(message).__name__}"
        return message

    def _send(self, message) -> None:
        if self._conn is None or self._death is not None:
            raise self._death or WorkerDiedError("the worker is not running")
        self._outbox.put(message)

    def _write(self) -> None:
        """Writer thread: sends queued messages in order (a failure shows up as the
        worker's death, which the reader reports)."""
        conn = self._conn
        while True:
            message = self._outbox.get()
            if message is _STOP_WRITING:
                return
            try:
                conn.send(message)
            except (OSError, ValueError):
                return

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        """Reader thread: forwards every message to the loop; on end-of-file, the death."""
        conn, inbox = self._conn, self._inbox
        while True:
            try:
                message = conn.recv()
            except Exception:  # noqa: BLE001 - end of file, or a message that cannot be read
                break
            if not self._post(loop, inbox, message):
                return
        proc = self._proc
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        error = WorkerDiedError(f"the worker process exited ({describe_exit(proc.poll())})")
        self._post(loop, inbox, error)

    def _post(self, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue, message) -> bool:
        def deliver() -> None:
            inbox.put_nowait(message)
            if isinstance(message, WorkerDiedError):
                self._death = message
                if self._on_death is not None:
                    self._on_death()

        try:
            loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return False
        return True

    def fail(self, error: WorkerDiedError) -> None:
        """Marks the worker dead from outside (another rank of its group died): a pending or
        later receive raises ``error``."""
        if self._death is None and self._inbox is not None:
            self._death = error
            self._inbox.put_nowait(error)

    def kill(self) -> None:
        """Kills the worker at once (SIGKILL); for fault tests."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Asks the worker to exit, then terminates and finally kills it if it lingers."""
        proc, conn = self._proc, self._conn
        if self._reader is None:  # a standby never started: nothing to drain
            if proc is not None and proc.poll() is None:
                proc.kill()
                await asyncio.get_running_loop().run_in_executor(None, proc.wait)
            if conn is not None:
                conn.close()
                self._conn = None
            return
        if conn is not None and self._death is None:
            self._outbox.put(Shutdown())
        if proc is not None:
            loop = asyncio.get_running_loop()
            for stop in (None, proc.terminate, proc.kill):
                if proc.poll() is not None:
                    break
                if stop is not None:
                    stop()
                try:
                    await loop.run_in_executor(None, proc.wait, timeout)
                except subprocess.TimeoutExpired:
                    pass
            # NOTE: the reader sees end-of-file once the process is gone; the socket is
            # closed only after both threads are done with it.
            self._outbox.put(_STOP_WRITING)
            for thread in (self._reader, self._writer):
                if thread is not None:
                    await loop.run_in_executor(None, thread.join, timeout)
        if conn is not None:
            conn.close()
            self._conn = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class WorkerGroup:
    """The worker processes of the tensor-parallel ranks, driven like one worker.

    Every rank gets its WorkerInit over its own socket (that socket is also how the
    engine sees a rank die); steps go to rank 0 only, which hands them to the others over
    torch.distributed, and rank 0 answers. When any rank dies the whole group counts as
    dead: a pending receive raises at once, and the engine restarts every rank.

    Args:
        init: What to load; rank, world size and rendezvous are filled in per rank.
        world_size: Number of ranks.
        on_death: Called on the event loop when a rank is found dead.
    """

    def __init__(self, init: WorkerInit, world_size: int, on_death: Callable[[], None] | None = None) -> None:
        from dataclasses import replace

        self._on_death = on_death
        method = f"tcp://127.0.0.1:{free_port()}"
        self.workers = [WorkerProcess(replace(init, rank=rank, world_size=world_size, dist_init_method=method),
                                      on_death=self._rank_died) for rank in range(world_size)]
        self.ready: WorkerReady | None = None

    def _rank_died(self) -> None:
        dead = next((w.death for w in self.workers if w.death is not None), None)
        if dead is not None:
            self.workers[0].fail(dead)
        if self._on_death is not None:
            self._on_death()

    @property
    def pid(self) -> int | None:
        return self.workers[0].pid

    @property
    def death(self) -> WorkerDiedError | None:
        return next((w.death for w in self.workers if w.death is not None), None)

    @property
    def pids(self) -> list[int | None]:
        return [w.pid for w in self.workers]

    def is_alive(self) -> bool:
        return all(w.is_alive() for w in self.workers)

    async def start(self, size_kv: SizeKVCache | None = None) -> WorkerReady:
        results = await self._every_rank(w.load() for w in self.workers)
        if isinstance(results[0], WorkerMemory):
            try:
                allocation = size_kv([r.memory for r in results])
            except BaseException:
                await self.shutdown(timeout=1.0)
                raise
            results = await self._every_rank(w.allocate(allocation) for w in self.workers)
        self.ready = results[0]
        return self.ready

    async def _every_rank(self, calls) -> list:
        """Awaits one call per rank; as soon as one fails, stops every rank and raises its
        error (the others may be waiting in a collective for the rank that failed)."""
        tasks = [asyncio.ensure_future(call) for call in calls]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        errors = [task.exception() for task in done if task.exception() is not None]
        if errors:
            for task in pending:
                task.cancel()
            await self.shutdown(timeout=1.0)
            raise errors[0]
        return [task.result() for task in tasks]

    def check(self) -> None:
        for worker in self.workers:
            worker.check()

    def send(self, scheduler_output: SchedulerOutput) -> None:
        self.workers[0].send(scheduler_output)

    async def recv(self):
        return await self.workers[0].recv()

    async def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.send(scheduler_output)
        return await self.recv()

    def kill(self) -> None:
        self.workers[0].kill()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stops rank 0 first (it tells the others), then every rank."""
        await self.workers[0].shutdown(timeout)
        await asyncio.gather(*(w.shutdown(timeout) for w in self.workers[1:]))
