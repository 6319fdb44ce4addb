"""The start plan: the model's dtype, how its weights are quantized (and the draft model's), the
attention backend and batch invariance, decided once in the engine process before any worker
starts, and sent to every worker in its WorkerInit (a worker, and a restarted one, takes them as
they are; it decides none of them again).

The engine needs them itself: the backend says whether a model whose every layer has a sliding
window is served past it (engine/core/kv_sizing.py), and batch invariance whether a standby
worker preloads the compiler (engine/executor/multiproc.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagoda.attention_backends import SUPPORTED_ATTENTION_BACKENDS, get_attention_backend
from pagoda.engine.config import EngineConfig
from pagoda.engine.messages import StartPlan
from pagoda.engine.model_config import ModelConfig
from pagoda.engine.model_loader import plan_quantization
from pagoda.engine.models.linear import choose_packing
from pagoda.engine.models.one_call_forward import architecture_reason
from pagoda.engine.platform import attention_shape, resolve_dtype, resolve_kv_cache_dtype

logger = logging.getLogger(__name__)


def resolve_batch_invariant(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                            fp8_cache: torch.dtype | None, model_config: ModelConfig, backend_name: str,
                            world_size: int) -> bool:
    """EngineConfig.batch_invariant as the workers run it: as asked, or (None) on where it
    costs little, which is where the default path already sums every row alike: bfloat16
    products on Pagoda's AVX512-BF16 kernel without AMX tiles (the "blocked" packing, the
    same whatever the rows), cpu_paged attention over a bfloat16 cache, every step in one C
    call (a family that runs layer by layer would lose its compiled regions), one rank, no
    LoRA. Measured on AMD Zen 4: at most 6% on any `pagoda bench compare` row, with GGUF
    and dense weights (docs/engine.md#batch-invariance); on AMX tiles it costs up to 2.7x,
    so it stays off there unless asked."""
    if config.batch_invariant is not None:
        return config.batch_invariant
    return (device.type == "cpu" and choose_packing(device, dtype) == "blocked" and backend_name == "cpu_paged"
            and fp8_cache is None and world_size == 1 and not config.enable_lora
            and architecture_reason(model_config) is None)


def plan_start(config: EngineConfig, model_dir: Path, model_config: ModelConfig, device: torch.device,
               draft_dir: Path | None = None) -> StartPlan:
    """The start plan for this configuration and model (and speculative decoding's draft model
    in ``draft_dir``) on ``device`` (rank 0's: every rank's device is of the same type).

    Raises:
        ValueError: The dtype, the quantization or the attention backend cannot run here (the
            message says why).
    """
    world_size = config.tensor_parallel_size
    quantization = plan_quantization(config.quantization, model_dir, device, world_size)
    draft_quantization = None if draft_dir is None else plan_quantization(config.quantization, draft_dir, device,
                                                                          world_size)
    dtype = resolve_dtype(config.dtype, device, quantized_weights=quantization is not None)
    fp8_cache = resolve_kv_cache_dtype(config.kv_cache_dtype)
    # NOTE: batch invariance asked for runs on cpu_paged, which computes each query row alone in
    # fixed partitions of keys (engine/compatibility.py refuses any other backend named with it).
    backend = get_attention_backend("cpu_paged" if config.batch_invariant else config.attention_backend, device,
                                    fp8_cache, attention_shape(model_config, dtype))
    invariant = resolve_batch_invariant(config, device, dtype, fp8_cache, model_config, backend.name, world_size)
    if invariant and config.batch_invariant is None:
        logger.info("outputs batch-invariant (the default on this CPU: AVX512-BF16 without AMX tiles, where it "
                    "costs little; --no-batch-invariant turns it off)")
    return StartPlan(dtype=str(dtype).removeprefix("torch."), quantization=quantization,
                     draft_quantization=draft_quantization, attention_backend=backend.name, batch_invariant=invariant)


def runs_windows(plan: StartPlan, model_config: ModelConfig) -> bool:
    """Whether the planned attention backend runs sliding windows in the planned dtype (then a
    model whose every layer has one is served past it, engine/core/kv_sizing.py; else within)."""
    backend = SUPPORTED_ATTENTION_BACKENDS[plan.attention_backend]()
    return backend.supports_window_and_softcap and backend.shape_problem(
        getattr(torch, plan.dtype), model_config.head_dim, model_config.num_attention_heads,
        model_config.num_key_value_heads, window_or_softcap=True) is None
