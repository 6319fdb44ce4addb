"""The worker process: ``python -m pagoda.engine.worker.main --fd N``.

The engine starts the worker as an interpreter of its own (not a multiprocessing
spawn), so it never imports the user's ``__main__``: scripts without an
``if __name__ == "__main__":`` guard, scripts on stdin, ``python -c`` and notebooks all
work. The engine hands it one end of a socket pair (file descriptor ``N``); the first
message on it is a :class:`~pagoda.engine.messages.WorkerInit`, after which the worker answers
one message per step until it is told to stop or the engine's end closes.

Anything that goes wrong while starting, the import of torch and the model included,
goes back to the engine as a traceback (:class:`~pagoda.engine.messages.WorkerFailed`).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from pagoda.engine.cpu_affinity import (
    WORKER_CPUS_ENV,
    cgroup_cpu_limit,
    format_cpus,
    openmp_binds,
    take_worker_cpus,
)


def serve(conn: Connection, preloading: threading.Thread | None = None) -> None:
    """Loads the model described by the first message, then runs steps until told to stop.

    Args:
        conn: The engine's socket.
        preloading: A standby's imports (:func:`preload`), finished before the model loads.
    """
    try:
        init = conn.recv()
    except (EOFError, OSError):
        return
    waited = time.perf_counter()
    if preloading is not None:
        preloading.join()
    waited = time.perf_counter() - waited

    def progress(message: str) -> None:
        from pagoda.engine.messages import WorkerProgress

        conn.send(WorkerProgress(message))

    if preloading is not None and waited > 0.1 and init.rank == 0:
        # NOTE: its imports run at idle priority, and a machine busy since it started may not
        # have left them time.
        progress(f"the standby's imports were not done: waited {waited:.1f} s for them")

    try:
        runner = build_runner(init, progress if init.rank == 0 else None)
        if runner.kv_caches is None:
            # Sized from the device's memory: the engine decides from what every rank measured.
            from pagoda.engine.messages import WorkerMemory

            conn.send(WorkerMemory(runner.measure_memory()))
            try:
                allocation = conn.recv()
            except (EOFError, OSError):
                return
            runner.allocate(allocation)
    except BaseException:  # noqa: BLE001 - the engine reports it; SystemExit from a library too
        _send_failure(conn, traceback.format_exc())
        return
    # NOTE: the model, its compiled regions and the libraries' objects live as long as the
    # worker; frozen, the collector's full passes between steps no longer walk them.
    gc.collect()
    gc.freeze()
    conn.send(ready_message(runner))
    if init.rank == 0:
        lead(runner, conn.recv, conn.send, conn.poll)
    else:
        follow(runner)


def preload(compiler: bool) -> None:
    """A standby worker's imports, made while the engine's current worker serves: torch, the
    model runner and, with ``compiler``, what loading compiled regions needs (several seconds,
    most of a restart).

    Runs in a thread of its own scheduled SCHED_IDLE (Linux), so it takes only CPU time that
    nothing else wants; the thread's priority goes with it, the rest of the worker runs at
    the normal one.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
    except (AttributeError, OSError):
        pass
    import pagoda.engine.worker.model_runner  # noqa: F401 - torch with it
    if compiler:
        from pagoda.engine.models.precompiled import import_loader

        import_loader()


def build_runner(init, progress=None):
    """The model runner of one rank (joins the tensor-parallel group when there are several).

    Args:
        init: What to load.
        progress: Called with a line for each start-up stage (None: silent).
    """
    import torch

    from pagoda.engine.platform import resolve_device
    from pagoda.engine.worker.cpu_threads import default_threads
    from pagoda.engine.worker.model_runner import ModelRunner

    threads = init.config.num_threads
    if threads is None:
        # NOTE: tensor-parallel ranks share the cores (or have their own share, where OpenMP
        # binds: engine/cpu_affinity.py); a container's CPU quota caps them.
        limit = cgroup_cpu_limit()
        device_type = resolve_device(init.config.device).type
        own_share = openmp_binds() and os.environ.get(WORKER_CPUS_ENV) is not None
        threads, by_quota = default_threads(init.world_size, device_type, limit, torch.get_num_threads(), own_share)
        if by_quota and progress is not None:
            progress(f"torch threads: {threads} (the cgroup's CPU quota: {limit:g} CPU{'' if limit == 1 else 's'})")
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(init.config.seed)
    return ModelRunner(init, progress)


def describe_threads() -> str:
    """"2 threads on CPUs 0-1": this worker's torch threads and the CPUs it may run on."""
    import torch

    threads = torch.get_num_threads()
    where = f" on CPUs {format_cpus(frozenset(os.sched_getaffinity(0)))}" if hasattr(os, "sched_getaffinity") else ""
    return f"{threads} thread{'' if threads == 1 else 's'}{where}"


def ready_message(runner):
    from pagoda.engine.messages import WorkerReady

    return WorkerReady(device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
                       attention_backend=runner.attention_backend.name, kv_cache_bytes=runner.kv_cache_bytes,
                       pid=os.getpid(), compile_seconds=runner.compile_seconds,
                       compiled=runner.compile_description,
                       weights=runner.weights_description, one_call_forward=runner.one_call_forward,
                       batch_invariant=runner.batch_invariant,
                       weight_bytes_per_token=runner.model.weight_bytes_per_token(),
                       cuda_graphs=runner.graphs_description, threads=describe_threads(),
                       kv_offload_namespace=runner.offload.target.namespace.hex()
                       if runner.offload and runner.offload.target else "",
                       kv_offload_file_bytes=runner.offload.file_bytes if runner.offload else 0)


def lead(runner, receive, send, poll=None) -> None:
    """Rank 0: takes each step from the engine, hands it to the other ranks, runs it, answers;
    between steps, writes the disk tier's blocks (until ``poll()`` says the next step is there).

    Returns when told to stop or when the engine goes away; the other ranks are told to
    stop either way.
    """
    from pagoda.engine.messages import SchedulerOutput, Shutdown

    answered = None  # when the previous answer went out
    while True:
        try:
            message = receive()
        except (EOFError, OSError):
            message = None
        received = time.perf_counter()
        if not isinstance(message, SchedulerOutput):
            if runner.offload is not None and not runner.offload.flush():
                print("pagoda worker: the KV blocks still queued for disk were not all written", file=sys.stderr)
            runner.tp.broadcast_object(Shutdown())
            runner.tp.synchronize()  # the process exits right after (os._exit)
            return
        output = run_step(runner, message)
        output.idle_seconds = 0.0 if answered is None else received - answered
        send(output)
        answered = time.perf_counter()
        if runner.offload is not None and poll is not None:
            runner.offload.write(lambda: not poll())


def run_step(runner, message):
    """Rank 0's part of one step: hand it to the other ranks, run it, time it."""
    start = time.perf_counter()
    runner.tp.broadcast_object(message)
    output = runner.execute(message)
    output.compute_seconds = time.perf_counter() - start
    return output


def follow(runner) -> None:
    """Ranks above 0: run every step rank 0 hands out, until it says stop."""
    from pagoda.engine.messages import Shutdown

    while True:
        message = runner.tp.broadcast_object()
        if isinstance(message, Shutdown):
            return
        runner.execute(message)


def _send_failure(conn: Connection, error: str) -> None:
    from pagoda.engine.messages import WorkerFailed

    try:
        conn.send(WorkerFailed(error))
    except OSError:
        print(error, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.engine.worker.main", description="Pagoda's model worker")
    parser.add_argument("--fd", type=int, required=True, help="file descriptor of the engine's socket")
    parser.add_argument("--standby", action="store_true",
                        help="import torch and the model's code before the engine says what to load")
    parser.add_argument("--preload-compiler", action="store_true",
                        help="with --standby: import what loading the compiled model needs too")
    args = parser.parse_args(argv)
    # NOTE: before torch is imported (the standby's preload, or the model's load): its OpenMP
    # binds threads within the mask it finds.
    take_worker_cpus()
    # NOTE: Ctrl-C reaches the whole process group; the engine process decides when the
    # worker stops (it drains requests first), so the worker leaves SIGINT to it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # NOTE: not inherited by anything this process starts, so that its death still closes
    # the socket (the engine notices a dead worker by that).
    os.set_inheritable(args.fd, False)
    conn = Connection(args.fd)
    preloading = None
    if args.standby:
        preloading = threading.Thread(target=preload, args=(args.preload_compiler,), name="pagoda-preload",
                                      daemon=True)
        preloading.start()
    try:
        serve(conn, preloading)
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    code = main()
    # NOTE: no interpreter finalisation: with torch loaded it took about a second of every
    # stop (and restart), and there is nothing left to save: the socket is closed. The
    # buffered output goes first (Python's and the C library's: oneDNN's or NCCL's logs).
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)
    os._exit(code)
