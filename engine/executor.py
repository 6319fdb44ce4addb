"""The engine's handle on the worker subprocess: spawn, one round trip per step, stop."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.config import EngineConfig
from engine.messages import RunnerOutput, SchedulerOutput, Shutdown, WorkerFailed, WorkerReady
from engine.models.config import ModelConfig
from engine.worker import worker_main


class WorkerDiedError(RuntimeError):
    """The worker process exited or could not start."""


class WorkerProcess:
    """Runs the model in a spawned subprocess and talks to it over a pipe.

    Receiving happens on a dedicated thread so the event loop keeps serving while the
    worker computes; a worker that dies closes its end of the pipe, which turns into
    WorkerDiedError instead of a hang.
    """

    def __init__(self, config: EngineConfig, model_dir: Path, model_config: ModelConfig, num_blocks: int,
                 max_model_len: int, num_cpu_blocks: int = 0) -> None:
        self._args = (config, model_dir, model_config, num_blocks, max_model_len, num_cpu_blocks)
        self._process: mp.process.BaseProcess | None = None
        self._conn = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-worker-io")
        self.ready: WorkerReady | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    async def start(self) -> WorkerReady:
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=worker_main, args=(child_conn, *self._args), name="pagoda-worker",
                                    daemon=True)
        self._process.start()
        # NOTE: closing our copy of the child's end is what makes a dead worker show up
        # as EOF on recv.
        child_conn.close()
        self._conn = parent_conn
        message = await self._recv()
        if isinstance(message, WorkerFailed):
            await self.shutdown()
            raise WorkerDiedError(f"the worker failed to start:\n{message.error}")
        assert isinstance(message, WorkerReady)
        self.ready = message
        return message

    async def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Sends one step and awaits its result."""
        if self._conn is None:
            raise WorkerDiedError("the worker is not running")
        try:
            self._conn.send(scheduler_output)
        except (OSError, ValueError) as exc:
            raise WorkerDiedError(f"the worker is gone ({exc})") from exc
        message = await self._recv()
        assert isinstance(message, RunnerOutput)
        return message

    async def _recv(self):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._recv_blocking)

    def _recv_blocking(self):
        try:
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            code = self._process.exitcode if self._process else None
            if self._process is not None:
                self._process.join(timeout=1)
                code = self._process.exitcode
            raise WorkerDiedError(f"the worker process exited (exit code {code})") from exc

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Asks the worker to exit, then terminates and finally kills it if it lingers."""
        process, conn = self._process, self._conn
        self._conn = None
        if conn is not None:
            try:
                conn.send(Shutdown())
            except (OSError, ValueError):
                pass
        if process is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, process.join, timeout)
            if process.is_alive():
                process.terminate()
                await loop.run_in_executor(None, process.join, timeout)
            if process.is_alive():
                process.kill()
                await loop.run_in_executor(None, process.join, timeout)
        if conn is not None:
            conn.close()
        self._thread.shutdown(wait=False, cancel_futures=True)
