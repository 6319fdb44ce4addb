"""The worker subprocess: loads the model, then answers one message per step."""

from __future__ import annotations

import signal
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from engine.config import EngineConfig
from engine.messages import SchedulerOutput, Shutdown, WorkerFailed, WorkerReady
from engine.models.config import ModelConfig


def worker_main(conn: Connection, config: EngineConfig, model_dir: Path, model_config: ModelConfig,
                num_blocks: int, max_model_len: int, num_cpu_blocks: int = 0) -> None:
    """Entry point of the spawned worker process.

    Exits when told to (Shutdown) or when the engine's end of the pipe closes, so a dead
    engine never leaves an orphan worker behind.
    """
    # NOTE: Ctrl-C reaches the whole process group; the engine process decides when the
    # worker stops (it drains requests first), so the worker leaves SIGINT to it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    try:
        from engine.model_runner import ModelRunner

        torch.manual_seed(config.seed)
        runner = ModelRunner(config, model_dir, model_config, num_blocks, max_model_len, num_cpu_blocks)
    except Exception:
        conn.send(WorkerFailed(traceback.format_exc()))
        return
    conn.send(WorkerReady(device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
                          attention_backend=runner.attention_backend.name,
                          kv_cache_bytes=runner.kv_cache_bytes))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if isinstance(message, Shutdown):
            return
        assert isinstance(message, SchedulerOutput), f"unexpected message {type(message).__name__}"
        conn.send(runner.execute(message))
