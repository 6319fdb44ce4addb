"""The matrix products of csrc/packed_linear.c and csrc/quant_linear.c (and the one call's SiLU):
weights packed for them, and the wrappers that check operands and call them."""

from __future__ import annotations

import functools
import logging

import torch

from pagoda.native.library import _kernel, available, cpu_flags, load

logger = logging.getLogger(__name__)

PACKED_LINEAR_GROUP = 64


def packed_linear_available() -> bool:
    """Whether packed_linear runs here: the library loads and this CPU has AVX512-BF16."""
    return available() and bool(load().packed_linear_available())


@functools.cache
def packed_linear_amx_available() -> bool:
    """Whether packed_linear can run on AMX tiles here: the kernel was built with them and
    one tile product ran (in a forked child, so a CPU that lists AMX but faults on it
    costs nothing; see amx_probe in csrc/packed_linear.c)."""
    if not packed_linear_available():
        return False
    ok = bool(load().amx_probe())
    if not ok and " amx_bf16" in cpu_flags():
        logger.warning("this CPU lists amx_bf16 but a tile product did not run; the linear layers will not use AMX")
    return ok


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] bfloat16 weight in packed_linear's layout: [ceil(N/64), ceil(K/2), 64, 2],
    zero-padded (see csrc/packed_linear.c)."""
    n, k = weight.shape
    group = PACKED_LINEAR_GROUP
    padded = weight.new_zeros(-(-n // group) * group, -(-k // 2) * 2)
    padded[:n, :k] = weight
    return padded.view(-1, group, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_silu_mul_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [2I, K] bfloat16 weight (gate_proj's I rows, then up_proj's) in
    packed_silu_mul_linear's layout: the groups of pack_linear_weight, each holding 32 gate
    features and then the same 32 up features (zero beyond I)."""
    n, k = weight.shape
    half = PACKED_LINEAR_GROUP // 2
    chunks = -(-n // 2 // half)
    paired = weight.new_zeros(chunks, 2, half, k)
    for i, part in enumerate(weight.chunk(2)):
        padded = weight.new_zeros(chunks * half, k)
        padded[: part.shape[0]] = part
        paired[:, i] = padded.view(chunks, half, k)
    return pack_linear_weight(paired.view(-1, k))


def _check_linear_input(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    assert x.dim() == 2 and x.dtype == weight.dtype == torch.bfloat16 and weight.is_contiguous()
    assert weight.shape[1] == -(-x.shape[1] // 2) and weight.shape[0] * PACKED_LINEAR_GROUP >= out_features
    return x if x.stride(1) == 1 else x.contiguous()


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                  amx_min_rows: int = 0, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x @ W.T + bias for a 2-D bfloat16 x and a weight from pack_linear_weight.

    With ``amx_min_rows`` > 0, an x of at least that many rows is multiplied on AMX tiles
    (only pass it where packed_linear_amx_available(); the sums differ from the AVX512
    path's by rounding). ``out_dtype`` float32 returns the float32 sums unrounded (logits).

    Returns:
        [x rows, out_features] in out_dtype.
    """
    x = _check_linear_input(x, weight, out_features)
    m, k = x.shape
    if bias is not None:
        assert bias.dtype == torch.bfloat16 and bias.is_contiguous() and bias.shape == (out_features,)
    assert out_dtype in (torch.bfloat16, torch.float32)
    out = torch.empty(m, out_features, dtype=out_dtype)
    if m:
        _kernel("packed_linear_bf16")(x.data_ptr(), m, x.stride(0), weight.data_ptr(), out_features, k,
                                      None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                                      amx_min_rows, int(out_dtype == torch.float32))
    return out


def packed_linear_accumulate(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, amx_min_rows: int = 0) -> None:
    """y += x @ W.T in place, for a 2-D bfloat16 x, a weight from pack_linear_weight and a
    contiguous bfloat16 y: the float32 sums added to y's values and rounded once (a LoRA delta)."""
    x = _check_linear_input(x, weight, y.shape[1])
    assert y.dtype == torch.bfloat16 and y.is_contiguous() and y.shape[0] == x.shape[0]
    m, k = x.shape
    if m:
        _kernel("packed_linear_bf16")(x.data_ptr(), m, x.stride(0), weight.data_ptr(), y.shape[1], k, None,
                                      y.data_ptr(), y.shape[1], amx_min_rows, 2)


def packed_silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, intermediate_size: int,
                           amx_min_rows: int = 0) -> torch.Tensor:
    """SiLU(x @ G.T) * (x @ U.T) for a 2-D bfloat16 x and a weight from
    pack_silu_mul_weight(cat(G, U)); ``amx_min_rows`` as for packed_linear.

    Returns:
        [x rows, intermediate_size] bfloat16.
    """
    x = _check_linear_input(x, weight, 2 * intermediate_size)
    m, k = x.shape
    out = torch.empty(m, intermediate_size, dtype=torch.bfloat16)
    if m:
        _kernel("packed_silu_mul_linear_bf16")(x.data_ptr(), m, x.stride(0), weight.data_ptr(), intermediate_size,
                                               k, out.data_ptr(), intermediate_size, amx_min_rows)
    return out


# -- the quantized linear layer (csrc/quant_linear.c) ---------------------------------------

QUANT_GROUP = 32  # input features per scale
QUANT_BLOCK = 16  # output features per block of the packed layout


@functools.cache
def _quant_group_bytes(bits: int, has_min: bool) -> int:
    return _kernel("quant_group_bytes")(bits, int(has_min))


def quant_linear_vector() -> bool:
    """Whether the quantized kernel was built with vector instructions (AVX512-VNNI or AVX2),
    else it is the portable C loop, for correctness only."""
    return available() and bool(load().quant_linear_vector())


def quant_linear_q6() -> bool:
    """Whether the quantized kernel runs 6-bit weights (its AVX512-VNNI build)."""
    return available() and bool(load().quant_linear_q6())


def quant_linear_vnni() -> bool:
    """Whether the quantized kernel was built with AVX512-VNNI (else AVX2 or its portable C loop)."""
    return available() and bool(load().quant_linear_vnni())


def _quant_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int, bits: int,
                    has_min: bool) -> torch.Tensor:
    """Checks the quantized kernel's operands; returns x with its rows' elements contiguous."""
    assert x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32) and weight.dtype == torch.uint8
    k = x.shape[1]
    assert k % QUANT_GROUP == 0 and weight.is_contiguous()
    assert weight.numel() == -(-out_features // QUANT_BLOCK) * (k // QUANT_GROUP) * _quant_group_bytes(bits, has_min)
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (out_features,)
    return x if x.stride(1) == 1 else x.contiguous()


def quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int, bits: int,
                 has_min: bool, out_f32: bool = False, amx_min_rows: int = 0) -> torch.Tensor:
    """x @ W.T + bias for a 2-D bfloat16 or float32 x and a weight packed by
    engine/models/quantized.py (``bits`` 8 or 4, with or without minimums, or 6 without where
    :func:`quant_linear_q6`); bias float32.
    From ``amx_min_rows`` rows (0: never) of bfloat16 x without bias, on AMX tiles: pass it
    only where :func:`packed_linear_amx_available` (the tiles proved to run).

    Returns:
        [x rows, out_features] in x's dtype, or float32 with ``out_f32``.
    """
    x = _quant_operands(x, weight, bias, out_features, bits, has_min)
    m, k = x.shape
    out_f32 = out_f32 or x.dtype == torch.float32
    out = torch.empty(m, out_features, dtype=torch.float32 if out_f32 else x.dtype)
    if m:
        _check_quant(_kernel("quant_linear")(x.data_ptr(), m, x.stride(0), int(x.dtype == torch.float32), k,
                                             weight.data_ptr(), bits, int(has_min), out_features,
                                             None if bias is None else bias.data_ptr(), out.data_ptr(), out_features,
                                             int(out_f32), amx_min_rows), "quant_linear")
    return out


def _check_quant(status: int, name: str) -> None:
    """Raises for a quantized kernel's failure status."""
    if status == -2:
        raise RuntimeError(f"{name}: 6-bit weights run on the quantized kernel's AVX512-VNNI build only")
    if status:
        raise MemoryError(f"{name}: out of memory for the quantized activations")


def quant_silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, intermediate_size: int, bits: int, has_min: bool,
                          amx_min_rows: int = 0) -> torch.Tensor:
    """SiLU(gate) * up of a bfloat16 x's product with a quantized gate/up weight (gate's
    features, then up's): from ``amx_min_rows`` rows (0: never) on AMX tiles with the
    activation in the product's epilogue (pass it only where :func:`packed_linear_amx_available`);
    else quant_linear, then :func:`silu_mul`.

    Returns:
        bfloat16 [x rows, intermediate_size].
    """
    assert x.dtype == torch.bfloat16
    x = _quant_operands(x, weight, None, 2 * intermediate_size, bits, has_min)
    m, k = x.shape
    out = torch.empty(m, intermediate_size, dtype=torch.bfloat16)
    if m and _kernel("quant_silu_mul_linear")(x.data_ptr(), m, x.stride(0), k, weight.data_ptr(), bits, int(has_min),
                                              intermediate_size, out.data_ptr(), amx_min_rows, None):
        raise MemoryError("quant_silu_mul_linear: out of memory")
    return out


def quant_linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                        bits: int, has_min: bool, amx_min_rows: int = 0) -> torch.Tensor:
    """Each row's index of its largest output of ``quant_linear(..., out_f32=True)`` with the same
    ``amx_min_rows`` (the first on ties), without writing the outputs: greedy sampling's LM head.

    Returns:
        int64 [x rows].
    """
    x = _quant_operands(x, weight, bias, out_features, bits, has_min)
    m, k = x.shape
    ids = torch.empty(m, dtype=torch.int64)
    if m:
        _check_quant(_kernel("quant_linear_argmax")(x.data_ptr(), m, x.stride(0), int(x.dtype == torch.float32), k,
                                                    weight.data_ptr(), bits, int(has_min), out_features,
                                                    None if bias is None else bias.data_ptr(), ids.data_ptr(),
                                                    amx_min_rows), "quant_linear_argmax")
    return ids


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, rounded to bfloat16 once, from a bfloat16 [rows, 2 * intermediate] gate/up
    product, as csrc/one_call_forward.c computes it."""
    assert gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0
    gate_up = gate_up.contiguous()
    rows, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, intermediate, dtype=torch.bfloat16)
    _kernel("silu_mul_bf16")(gate_up.data_ptr(), rows, intermediate, out.data_ptr())
    return out


#: csrc/one_call_forward.c's struct layer_product kinds.
QUANTIZED_PRODUCT, BLOCKED_PRODUCT = 0, 1


def moe_layer_struct(gate_up: torch.Tensor, gate_up_product: tuple[int, int, int], down: torch.Tensor,
                     down_product: tuple[int, int, int], intermediate: int, top_k: int, norm_topk_prob: bool,
                     router: tuple[int, int, int, int] = (0, 0, 0, 0)) -> list[int]:
    """csrc/one_call_forward.c's struct moe_layer, one int64 a field: ``router`` the router's
    struct layer_product (weight address, kind, a, b; zeros where the caller routes),
    ``gate_up`` and ``down`` [experts, ...] each expert's packed weight and ``*_product`` the
    kernel's (kind, a, b) for them."""
    assert gate_up.is_contiguous() and down.is_contiguous() and gate_up.shape[0] == down.shape[0]
    assert 0 < top_k <= gate_up.shape[0]
    return [*router, gate_up.data_ptr(), *gate_up_product, down.data_ptr(), *down_product, gate_up[0].nbytes,
            down[0].nbytes, gate_up.shape[0], top_k, int(norm_topk_prob), intermediate]


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                gate_up_product: tuple[int, int, int], down: torch.Tensor, down_product: tuple[int, int, int],
                intermediate: int) -> torch.Tensor:
    """A mixture-of-experts layer's experts in one call (csrc/one_call_forward.c's
    moe_experts_forward): bfloat16 x [tokens, hidden], experts [tokens, k] int64, their routing
    weights [tokens, k] (float32); ``gate_up``, ``down`` and their products as
    :func:`moe_layer_struct` takes them.

    Raises:
        MemoryError: Out of memory.
        ValueError: An expert id out of range.
    """
    assert x.dtype == torch.bfloat16 and x.dim() == 2
    x = x.contiguous()
    experts = experts.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    layer = torch.tensor(moe_layer_struct(gate_up, gate_up_product, down, down_product, intermediate,
                                          experts.shape[1], False), dtype=torch.int64)
    out = torch.empty_like(x)
    failed = len(x) and _kernel("moe_experts_forward")(x.data_ptr(), len(x), x.shape[1], experts.data_ptr(),
                                                       weights.data_ptr(), layer.data_ptr(), out.data_ptr())
    if failed == -2:
        raise ValueError(f"expert ids must be in [0, {gate_up.shape[0]})")
    if failed:
        raise MemoryError("moe_experts_forward: out of memory")
    return out


def moe_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts ([tokens, k] int64, the lower id first among equal logits) and
    their routing weights ([tokens, k] float32 holding bfloat16 values) from bfloat16 router
    logits [tokens, experts], as csrc/one_call_forward.c's moe_route computes them for
    :func:`moe_layer`."""
    assert logits.dtype == torch.bfloat16 and logits.dim() == 2
    logits = logits.contiguous()
    experts = torch.empty(len(logits), top_k, dtype=torch.int64)
    weights = torch.empty(len(logits), top_k, dtype=torch.float32)
    _kernel("moe_route")(logits.data_ptr(), len(logits), logits.shape[1], top_k, int(norm_topk_prob),
                         experts.data_ptr(), weights.data_ptr())
    return experts, weights


def moe_layer(x: torch.Tensor, logits: torch.Tensor, layer: list[int]) -> torch.Tensor:
    """A mixture-of-experts layer's output for bfloat16 x [tokens, hidden] and its router's
    bfloat16 logits [tokens, experts], routed by :func:`moe_route` (csrc/one_call_forward.c's
    moe_layer_forward); ``layer`` :func:`moe_layer_struct`'s.

    Raises:
        MemoryError: Out of memory.
    """
    assert x.dtype == logits.dtype == torch.bfloat16 and x.dim() == logits.dim() == 2 and len(x) == len(logits)
    assert logits.shape[1] == layer[-4]
    x, logits = x.contiguous(), logits.contiguous()
    described = torch.tensor(layer, dtype=torch.int64)
    out = torch.empty_like(x)
    if len(x) and _kernel("moe_layer_forward")(x.data_ptr(), len(x), x.shape[1], logits.data_ptr(),
                                               described.data_ptr(), out.data_ptr()):
        raise MemoryError("moe_layer_forward: out of memory")
    return out
