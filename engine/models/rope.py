"""Rotary position embedding (RoPE) inverse frequencies.

The model code builds its cos/sin tables as
``freqs = positions[:, None] * inv_freq[None, :]`` and multiplies both tables by
the returned attention scaling factor, exactly like transformers'
``LlamaRotaryEmbedding.forward`` (rotate-half layout).

Supported ``rope_type`` values: ``default``, ``linear``, ``dynamic``, ``llama3``,
``yarn`` and ``longrope`` (Phi-3's 128k models, Phi-4-mini). The formulas follow transformers'
``ROPE_INIT_FUNCTIONS`` and are tested against it to 1e-6. The frequencies span the head's
``rotary_dim`` (all of it unless the model rotates only part of each head).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagoda.engine.model_config import ModelConfig


def compute_inv_freq(config: ModelConfig, max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Computes the RoPE inverse frequencies and attention scaling of a model.

    Args:
        config: The model configuration; ``rotary_dim``, ``rope_theta``,
            ``rope_scaling`` and ``max_position_embeddings`` are used.
        max_positions: The longest sequence the engine runs (its max_model_len). ``longrope``
            takes its long factors for every position when this passes the pretraining
            context, its short ones otherwise (llama.cpp's choice, by context size; transformers
            switches per forward, by the batch's longest sequence).

    Returns:
        ``(inv_freq, attention_scaling)``: a float32 CPU tensor of shape
        ``[rotary_dim // 2]`` and the factor ("mscale") that multiplies cos and
        sin. The factor is 1.0 for every type except ``yarn`` and ``longrope``.

    Raises:
        ValueError: If the RoPE type is unknown or a required parameter is
            missing.

    Note:
        ``dynamic`` (dynamic NTK) rescales the base only once a sequence grows
        beyond ``max_position_embeddings``. We use the static form evaluated at
        ``seq_len = max_position_embeddings``, which equals the default
        frequencies; positions beyond that length are not rescaled, because
        the engine never schedules past ``max_position_embeddings``.
    """
    dim = config.rotary_dim
    base = float(config.rope_theta)
    params: dict[str, Any] = dict(config.rope_scaling or {})
    rope_type = params.get("rope_type", "default")

    if rope_type in ("default", "dynamic"):
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, dim) / float(_require(params, "factor")), 1.0
    if rope_type == "llama3":
        return _llama3(base, dim, params, config.max_position_embeddings), 1.0
    if rope_type == "yarn":
        return _yarn(base, dim, params, config.max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(base, dim, params, config.max_position_embeddings, max_positions)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    """Plain RoPE: ``base ** (-2i / dim)`` for ``i`` in ``[0, dim / 2)``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exponents)


def _require(params: dict[str, Any], key: str) -> Any:
    """Returns ``params[key]``, raising ValueError naming the missing key."""
    value = params.get(key)
    if value is None:
        raise ValueError(f"rope_scaling of type {params.get('rope_type')!r} needs {key!r}")
    return value


def _llama3(base: float, dim: int, params: dict[str, Any], max_positions: int) -> torch.Tensor:
    """Llama 3.1 scaling: low frequencies divided by ``factor``, smooth ramp between."""
    inv_freq = _base_inv_freq(base, dim)
    factor = float(_require(params, "factor"))
    low_freq_factor = float(_require(params, "low_freq_factor"))
    high_freq_factor = float(_require(params, "high_freq_factor"))
    old_context_len = params.get("original_max_position_embeddings") or max_positions

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(
    base: float, dim: int, params: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN: per-dimension blend of interpolated and extrapolated frequencies."""
    original_max = params.get("original_max_position_embeddings") or max_positions
    factor = params.get("factor")
    if factor is None:
        # NOTE: DeepSeek-style configs give only the two context lengths.
        factor = max_positions / original_max
    factor = float(factor)

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    truncate = params.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength completes `num_rotations` turns over
        # the original context.
        turns = original_max / (num_rotations * 2 * math.pi)
        return (dim * math.log(turns)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # Avoid dividing by zero in the ramp.
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp

    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_weight)
        + inv_freq_extrapolation * extrapolation_weight
    )
    return inv_freq, float(attention_factor)


def _longrope(base: float, dim: int, params: dict[str, Any], max_positions: int,
              engine_max: int | None) -> tuple[torch.Tensor, float]:
    """LongRoPE: each frequency divided by a factor of its own, from ``long_factor`` past the
    pretraining context and ``short_factor`` within it; cos and sin scaled by
    sqrt(1 + ln(stretch) / ln(original context)) unless the config gives ``attention_factor``."""
    original = int(_require(params, "original_max_position_embeddings"))
    long = engine_max is not None and engine_max > original
    factors = torch.tensor(_require(params, "long_factor" if long else "short_factor"), dtype=torch.float32)
    if factors.shape != (dim // 2,):
        raise ValueError(f"rope_scaling longrope: {'long' if long else 'short'}_factor has {factors.numel()} "
                         f"entries; the head rotates {dim} dimensions, which needs {dim // 2}")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        # NOTE: the stretch is "factor", or (Phi-3, which states no factor) the config's context
        # over the original one.
        stretch = float(params.get("factor") or max_positions / original)
        attention_factor = 1.0 if stretch <= 1 else math.sqrt(1 + math.log(stretch) / math.log(original))
    return _base_inv_freq(base, dim) / factors, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's recommended attention temperature for a context stretch ``scale``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
