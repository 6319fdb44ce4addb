"""Weights quantized in groups of 32 input features, for csrc/quant_linear.c.

Every quantized weight is held, until it is packed, as :class:`GroupQuantized`: integers
``values`` [N, K], and per group of 32 inputs a ``scale`` and optionally a ``min``, so that
``w = scale * value + min``. That form holds these GGUF types exactly (their blocks are read
here, not dequantized): Q8_0 (8-bit), Q4_0, Q4_1, Q4_K (4-bit), Q5_0, Q5_1, Q5_K (5-bit
values, kept as 8-bit). Q6_K (6-bit values with a scale per 16 inputs) is held so too, as
6-bit with two scales a group, where the kernel runs 6-bit weights (AVX512-VNNI vectors, not
on a CPU whose AMX tiles run: those take 8-bit weights in their products of many rows). Other
GGUF types (Q2_K, Q3_K, the IQ types; Q6_K elsewhere) are dequantized and quantized again to
8 bits per group of 32 (finer than their own steps; not exact). ``--quantization int8``
quantizes a float checkpoint the same way (symmetric, per group).

Scales and minimums are float16, as in GGUF's blocks; a K-quant's scale (its super-block's
float16 times a 6-bit integer) is rounded to float16 here (a relative error under 2^-11).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagoda.native import linear as linear_kernels
from pagoda.engine.model_loader import QUANTIZED_FILE, ROWS_AT_ONCE  # (a multiple of BLOCK)

GROUP = linear_kernels.QUANT_GROUP
BLOCK = linear_kernels.QUANT_BLOCK
#: The packings of quantized weights (the names linear.py dispatches on): bits, with minimums.
QUANT_PACKINGS = {"q8": (8, False), "q8m": (8, True), "q6": (6, False), "q4": (4, False), "q4m": (4, True)}
#: GGUF types read exactly (the rest are dequantized and quantized again to 8 bits).
EXACT_GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K")


@dataclass
class GroupQuantized:
    """``w[n, k] = scales[n, k // 32] * values[n, k] + mins[n, k // 32]``.

    values: int8 [N, K] (``bits`` 8: -128..127; ``bits`` 6: -32..31; ``bits`` 4: 0..15);
    scales, mins: float32 [N, K / 32] holding float16 values (mins None: zero); ``bits`` 6:
    scales [N, K / 16] (``scales[n, k // 16]``), no mins.
    """

    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @property
    def packing(self) -> str:
        return f"q{self.bits}" + ("m" if self.mins is not None else "")

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these stand for (the reference the kernel is tested against)."""
        group = self.values.shape[1] // self.scales.shape[1]
        expand = lambda t: t.repeat_interleave(group, dim=1)  # noqa: E731
        weight = self.values.float() * expand(self.scales)
        return weight if self.mins is None else weight + expand(self.mins)

    def rows(self, start: int, stop: int) -> GroupQuantized:
        """Rows ``start:stop`` of the weight."""
        return GroupQuantized(self.values[start:stop], self.scales[start:stop],
                              None if self.mins is None else self.mins[start:stop], self.bits)

    def nbytes_packed(self) -> int:
        n, k = self.shape
        return -(-n // BLOCK) * (k // GROUP) * _group_bytes(self.bits, self.mins is not None)

    @staticmethod
    def cat(parts: list[GroupQuantized]) -> GroupQuantized:
        """Rows of several weights (q, k, v; gate, up) as one; mixed types become 8-bit (a
        6-bit part beside others is quantized again, as its GGUF type is without the kernel)."""
        if len({part.bits == 6 for part in parts}) > 1:
            parts = [quantize_int8(part.dequantize()) if part.bits == 6 else part for part in parts]
        bits = max(part.bits for part in parts)
        with_mins = any(part.mins is not None for part in parts)
        mins = [part.mins if part.mins is not None else torch.zeros_like(part.scales) for part in parts]
        return GroupQuantized(torch.cat([part.values for part in parts]), torch.cat([part.scales for part in parts]),
                              torch.cat(mins) if with_mins else None, bits)


def _group_bytes(bits: int, has_min: bool) -> int:
    values = {8: 512, 6: 384, 4: 256}[bits]
    return values + 2 * BLOCK * (2 if has_min or bits == 6 else 1)


def six_bit_kernel() -> bool:
    """Whether Q6_K is held as 6-bit: the kernel runs 6-bit weights and no AMX tiles run (whose
    products of many rows take 8-bit weights, not 6-bit)."""
    return linear_kernels.quant_linear_q6() and not linear_kernels.packed_linear_amx_available()


def float16_rounded(values: np.ndarray | torch.Tensor) -> torch.Tensor:
    """float32 holding the float16 nearest to each value."""
    tensor = torch.as_tensor(np.asarray(values, dtype=np.float32))
    return tensor.half().float()


def quantize_int8(weight: torch.Tensor) -> GroupQuantized:
    """A float [N, K] weight (K a multiple of 32) as 8-bit integers with a float16 scale per
    group of 32, symmetric (the largest magnitude maps to 127)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int8 quantization needs in_features a multiple of {GROUP}, not {k}")
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
    scales = (groups.abs().amax(dim=2) / 127).half().float()
    inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    values = torch.round(groups * inverse.unsqueeze(2)).clamp(-127, 127).to(torch.int8)
    return GroupQuantized(values.reshape(n, k), scales, None, 8)


# -- GGUF blocks -----------------------------------------------------------------------------

def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32."""
    return blocks[:, start:start + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5 order: byte i's low nibble is element i, its high nibble element i + 16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and minimums of a K-quant super-block's eight sub-blocks ([B, 8] each)."""
    sc = np.empty((scales.shape[0], 8), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[:, :4] = scales[:, 0:4] & 63
    mn[:, :4] = scales[:, 4:8] & 63
    sc[:, 4:] = (scales[:, 8:12] & 0x0F) | ((scales[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (scales[:, 8:12] >> 4) | ((scales[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> GroupQuantized:
    """A GGUF tensor's blocks (uint8 [rows, bytes per row], as gguf.GGUFReader gives them) as
    GroupQuantized; ``shape`` is [N, K]."""
    n, k = shape
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)
    if type_name == "Q6_K" and six_bit_kernel():
        return _q6_k(raw.reshape(n * k // 256, -1), shape)
    if type_name not in EXACT_GGUF_TYPES:
        import gguf

        weight = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
        return quantize_int8(torch.from_numpy(np.asarray(weight, dtype=np.float32).reshape(n, k)))
    block_elems = 256 if type_name.endswith("_K") else 32
    blocks = raw.reshape(n * k // block_elems, -1)
    mins = None
    if type_name == "Q8_0":
        scales = _f16(blocks, 0)
        values = blocks[:, 2:34].view(np.int8)
        bits = 8
    elif type_name in ("Q4_0", "Q4_1"):
        scales = _f16(blocks, 0)
        offset = 2 if type_name == "Q4_0" else 4
        values = _nibbles_32(blocks[:, offset:offset + 16])
        mins = -8 * scales if type_name == "Q4_0" else _f16(blocks, 2)
        bits = 4
    elif type_name in ("Q5_0", "Q5_1"):
        scales = _f16(blocks, 0)
        offset = 2 if type_name == "Q5_0" else 4
        high = np.unpackbits(blocks[:, offset:offset + 4], axis=1, bitorder="little")  # bit j: element j
        values = _nibbles_32(blocks[:, offset + 4:offset + 20]) | (high << 4)
        if type_name == "Q5_0":
            values = values.astype(np.int16) - 16
        else:
            mins = _f16(blocks, 2)
        bits = 8
    else:  # Q4_K, Q5_K: super-blocks of 256, eight sub-blocks of 32
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _k_scales(blocks[:, 4:16])
        scales = d[:, None] * sc
        mins = -(dmin[:, None] * mn)
        if type_name == "Q4_K":
            qs = blocks[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 32 bytes: 64 elements each
            values = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
            bits = 4
        else:
            qh = np.unpackbits(blocks[:, 16:48], axis=1, bitorder="little").reshape(-1, 32, 8)  # [l, bit]
            qs = blocks[:, 48:176].reshape(-1, 4, 32)
            low = np.stack([qs & 0x0F, qs >> 4], axis=2)  # [B, chunk, half, l]
            high = qh.transpose(0, 2, 1).reshape(-1, 4, 2, 32)  # bit 2*chunk + half of qh[l]
            values = (low | (high << 4)).reshape(-1, 256)
            bits = 8
        scales, mins = scales.reshape(-1), mins.reshape(-1)
    values = torch.from_numpy(np.ascontiguousarray(values).astype(np.int8).reshape(n, k))
    return GroupQuantized(values, float16_rounded(scales).reshape(n, k // GROUP),
                          None if mins is None else float16_rounded(mins).reshape(n, k // GROUP), bits)


def _q6_k(blocks: np.ndarray, shape: tuple[int, int]) -> GroupQuantized:
    """Q6_K's super-blocks of 256 ([B, 210]: 128 bytes of low nibbles, 64 of top two bits, 16
    int8 scales, a float16 d) as 6-bit values with a float16 scale (d x scale) per 16."""
    n, k = shape
    low = blocks[:, :128].reshape(-1, 2, 2, 32)  # [half of 128, 32-byte run, l]
    top = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    # Element 128 half + 32 c + l: run c % 2's low nibble (c < 2) or high one, top bits 2c, 2c + 1.
    nibbles = np.stack([low & 0x0F, low >> 4], axis=2).reshape(-1, 2, 4, 32)
    tops = (top >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    values = ((nibbles | (tops << 4)).astype(np.int16) - 32).reshape(n, k)
    scales = _f16(blocks, 208)[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return GroupQuantized(torch.from_numpy(values.astype(np.int8)), float16_rounded(scales).reshape(n, k // 16),
                          None, 6)


class QuantizedCheckpoint:
    """A converted GGUF file's quantized tensors (``gguf/blocks.safetensors``), read one at a
    time on request: ``get(name)`` gives the tensor as GroupQuantized, or None where the
    file holds it in floats."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._handle = safe_open(str(path), framework="pt")
        self.types: dict[str, list] = json.loads(self._handle.metadata()["gguf_types"])
        # NOTE: the model asks by its own names, without the checkpoint's "model." prefix.
        self._stored = {name.removeprefix("model."): name for name in self.types}

    def get(self, name: str) -> GroupQuantized | None:
        stored = self._stored.get(name)
        if stored is None:
            return None
        type_name, rows, cols = self.types[stored]
        raw = self._handle.get_tensor(stored).numpy()
        parts = [from_gguf(raw[start:start + ROWS_AT_ONCE], type_name, (min(ROWS_AT_ONCE, rows - start), cols))
                 for start in range(0, rows, ROWS_AT_ONCE)]
        return parts[0] if len(parts) == 1 else GroupQuantized.cat(parts)  # (one part: no copy)

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for type_name, *_ in self.types.values():
            counts[type_name] = counts.get(type_name, 0) + 1
        return counts


def quantized_weights(model_dir: Path) -> QuantizedCheckpoint | None:
    """The quantized tensors of a model converted from GGUF, or None (a float checkpoint)."""
    path = Path(model_dir) / QUANTIZED_FILE
    return QuantizedCheckpoint(path) if path.is_file() else None


# -- the kernel's layout ---------------------------------------------------------------------

def pack(weight: GroupQuantized) -> torch.Tensor:
    """The uint8 layout csrc/quant_linear.c reads (see the top of that file); ROWS_AT_ONCE rows
    at a time (whole blocks: the layouts of consecutive rows follow one another)."""
    n, k = weight.shape
    if n > ROWS_AT_ONCE:
        return torch.cat([pack(weight.rows(start, start + ROWS_AT_ONCE)) for start in range(0, n, ROWS_AT_ONCE)])
    groups, blocks = k // GROUP, -(-n // BLOCK)
    values = torch.zeros(blocks * BLOCK, k, dtype=torch.int16)
    values[:n] = weight.values.to(torch.int16)
    if weight.bits == 8:
        # [block, feature, group, j, 4] -> [block, group, j, feature, 4]
        data = (values + 128).to(torch.uint8).view(blocks, BLOCK, groups, 8, 4).permute(0, 2, 3, 1, 4)
        parts = [data.reshape(blocks, groups, -1)]
    else:
        stored = (values + 32 if weight.bits == 6 else values).to(torch.uint8)
        nibbles = (stored & 0x0F).view(blocks, BLOCK, groups, 4, 2, 4)  # [..., j, low/high, i]
        data = (nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
        parts = [data.reshape(blocks, groups, -1)]
        if weight.bits == 6:
            # The top two bits: vector t = j // 2, field 2 (j % 2) + low/high of each byte i.
            tops = (stored >> 4).view(blocks, BLOCK, groups, 2, 2, 2, 4)  # [..., t, j % 2, low/high, i]
            fields = tops[..., 0, 0, :] | tops[..., 0, 1, :] << 2 | tops[..., 1, 0, :] << 4 | tops[..., 1, 1, :] << 6
            parts.append(fields.permute(0, 2, 3, 1, 4).reshape(blocks, groups, -1))
    tables = (weight.scales, weight.mins)
    per_group = weight.scales.shape[1] // groups  # 2 for 6-bit: inputs 0-15's, then 16-31's
    for table in tables:
        if table is None:
            continue
        padded = torch.zeros(blocks * BLOCK, groups * per_group, dtype=torch.float16)
        padded[:n] = table.half()
        parts.append(padded.view(blocks, BLOCK, groups, per_group).permute(0, 2, 3, 1).contiguous()
                     .view(torch.uint8).reshape(blocks, groups, -1))
    return torch.cat(parts, dim=2).reshape(-1).contiguous()
