"""The worker process: ``python -m engine.worker --fd N``.

The engine starts the worker as an interpreter of its own (not a multiprocessing
spawn), so it never imports the user's ``__main__``: scripts without an
``if __name__ == "__main__":`` guard, scripts on stdin, ``python -c`` and notebooks all
work. The engine hands it one end of a socket pair (file descriptor ``N``); the first
message on it is a :class:`~engine.messages.WorkerInit`, after which the worker answers
one message per step until it is told to stop or the engine's end closes.

Anything that goes wrong while starting, the import of torch and the model included,
goes back to the engine as a traceback (:class:`~engine.messages.WorkerFailed`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection


def serve(conn: Connection) -> None:
    """Loads the model described by the first message, then runs steps until told to stop."""
    try:
        init = conn.recv()
    except (EOFError, OSError):
        return
    try:
        import torch

        from engine.messages import WorkerReady
        from engine.model_runner import ModelRunner

        if init.config.num_threads is not None:
            torch.set_num_threads(init.config.num_threads)
        torch.manual_seed(init.config.seed)
        runner = ModelRunner(init)
    except BaseException:  # noqa: BLE001 - the engine reports it; SystemExit from a library too
        _send_failure(conn, traceback.format_exc())
        return
    conn.send(WorkerReady(device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
                          attention_backend=runner.attention_backend.name, kv_cache_bytes=runner.kv_cache_bytes,
                          pid=os.getpid(), compile_seconds=runner.compile_seconds))
    from engine.messages import SchedulerOutput, Shutdown

    answered = None  # when the previous answer went out
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        received = time.perf_counter()
        if isinstance(message, Shutdown):
            return
        assert isinstance(message, SchedulerOutput), f"unexpected message {type(message).__name__}"
        output = runner.execute(message)
        output.compute_seconds = time.perf_counter() - received
        output.idle_seconds = 0.0 if answered is None else received - answered
        conn.send(output)
        answered = time.perf_counter()


def _send_failure(conn: Connection, error: str) -> None:
    from engine.messages import WorkerFailed

    try:
        conn.send(WorkerFailed(error))
    except OSError:
        print(error, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.worker", description="Pagoda's model worker")
    parser.add_argument("--fd", type=int, required=True, help="file descriptor of the engine's socket")
    args = parser.parse_args(argv)
    # NOTE: Ctrl-C reaches the whole process group; the engine process decides when the
    # worker stops (it drains requests first), so the worker leaves SIGINT to it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(args.fd)
    try:
        serve(conn)
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
