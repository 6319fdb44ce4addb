"""The engine's state as plain data, for the console and scripts: the KV block pool block by
block, every request's block table and progress, the queues, the recent steps.

Built on demand (a few times a second while a console watches), never on the step's path:
the step loop only appends one small tuple per step to ``StepLog`` when a console asked for
one (server/console.py).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

from pagoda.plugins import hookimpl

if TYPE_CHECKING:
    from pagoda.engine.core.kv_cache_manager import KVCacheManager
    from pagoda.engine.core.request import Request
    from pagoda.engine.core.scheduler import Scheduler
    from pagoda.plugins.views import StepView

#: How a console registers its step log as a plugin (``--plugin`` spec; one per engine).
STEP_LOG_SPEC = "pagoda.engine.core.snapshot:StepLog"
#: A block's state in ``blocks``: free (never cached, or evicted), in use by one request,
#: shared by several (copy-on-write forks, prefix hits), cached and free (evictable).
FREE, USED, SHARED, CACHED = 0, 1, 2, 3


class StepLog:
    """The recent steps (a plugin observer, registered only for a console): per step its id,
    time, tokens scheduled, requests running and waiting, KV usage."""

    def __init__(self, size: int = 240) -> None:
        self.steps: deque[tuple[int, float, int, int, int, float]] = deque(maxlen=size)

    @hookimpl
    def pagoda_step_finished(self, step: StepView) -> None:
        self.steps.append((step.step_id, time.time(), step.num_scheduled_tokens, step.num_running,
                           step.num_waiting, step.kv_cache_usage))


def kv_blocks(kv: KVCacheManager) -> tuple[list[int], list[int]]:
    """(state of each block, its reference count), in block id order."""
    states, refs = [], []
    for block in kv.all_blocks():
        refs.append(block.ref_cnt)
        if block.ref_cnt > 1:
            states.append(SHARED)
        elif block.ref_cnt == 1:
            states.append(USED)
        else:
            states.append(CACHED if block.block_hash is not None else FREE)
    return states, refs


def _request(request: Request, kv: KVCacheManager, queue: str) -> dict[str, Any]:
    metrics = request.metrics
    blocks = kv.get_block_ids(request.request_id, held=True)
    return {"id": request.request_id, "queue": queue, "status": request.status.name.lower(),
            "priority": request.priority, "client": request.client,
            "prompt_tokens": request.num_prompt_tokens, "output_tokens": request.num_output_tokens,
            "computed_tokens": request.num_computed_tokens, "max_tokens": request.max_tokens,
            "cached_tokens": metrics.num_cached_tokens, "preemptions": metrics.num_preemptions,
            "waited": round(time.time() - metrics.arrival_time, 3), "blocks": blocks,
            "swapped_blocks": kv.get_cpu_block_ids(request.request_id) if kv.is_swapped(request.request_id) else []}


def engine_snapshot(scheduler: Scheduler, step_log: StepLog | None = None) -> dict[str, Any]:
    """One replica's state: its KV blocks, requests, queues and recent steps."""
    kv = scheduler.kv_cache_manager
    states, refs = kv_blocks(kv)
    requests = [_request(r, kv, "running") for r in scheduler.running]
    requests += [_request(r, kv, "waiting") for r in scheduler.waiting]
    stats = scheduler.stats
    return {
        "time": time.time(),
        "kv": {"num_blocks": kv.num_blocks, "block_size": kv.block_size, "blocks": states, "ref_counts": refs,
               "num_free": kv.get_num_free_blocks(), "num_cpu_blocks": kv.num_cpu_blocks,
               "num_free_cpu_blocks": kv.num_free_cpu_blocks},
        "requests": requests,
        "num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
        "stats": {"preemptions": stats.num_preemptions, "prefix_cache_hits": stats.prefix_cache_hits,
                  "prefix_cache_queries": stats.prefix_cache_queries},
        "budget": {"max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens},
        "steps": [list(step) for step in step_log.steps] if step_log is not None else [],
    }
