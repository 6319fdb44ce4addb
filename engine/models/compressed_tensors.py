"""Checkpoints quantized in the compressed-tensors format (llm-compressor's, which vLLM serves):
8-bit integer weights (W8A8 and W8A16, ``int-quantized`` / ``naive-quantized``).

Such a checkpoint's ``config.json`` has a ``quantization_config`` with ``quant_method``
``compressed-tensors``; each quantized linear layer stores ``weight`` as int8 [N, K] and
``weight_scale`` (per output channel [N, 1], per tensor, or per group of inputs [N, K / g]),
so that ``w = weight_scale * weight``; static activation scales (``input_scale``) may be
there too. Pagoda reads the integers as they are into :class:`GroupQuantized` (the form
csrc/quant_linear.c multiplies: a scale per group of 32 inputs, here the layer's scale
repeated, rounded to float16: a relative error under 2^-11 for scales from 2^-14 up) and
quantizes activations itself, per row and group of 32 at run time (finer than the per-token or
static scales the checkpoint was calibrated with; a static ``input_scale`` is not used). Where
the quantized kernel does not run (EngineConfig.quantization ``none``, a GPU, neither
AVX512-VNNI nor AVX2, tensor parallelism, and under ``auto`` a CPU whose AMX tiles run), the
weights are dequantized with the checkpoint's exact scales.

Other compressed-tensors schemes (4-bit ``pack-quantized``, fp8 ``float-quantized``,
asymmetric weights with zero points, 2:4 sparsity) fail with an error that names them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagoda.engine.model_loader import check_compressed_tensors_scheme
from pagoda.engine.models.quantized import GROUP, GroupQuantized, float16_rounded


class CompressedTensorsCheckpoint:
    """Reads a compressed-tensors checkpoint's tensors: :meth:`dequantizing` passes the float
    tensors on and turns each quantized layer's integers into a float weight. With ``keep``
    (the quantized kernel will run them) it keeps the integers in :attr:`quantized`
    (checkpoint name, "model." dropped -> GroupQuantized) on the way; without, the float
    weight is the checkpoint's exact ``weight_scale * weight`` and nothing is kept."""

    def __init__(self, quantization: dict, keep: bool = True) -> None:
        self.description = check_compressed_tensors_scheme(quantization)
        self.keep = keep
        self.quantized: dict[str, GroupQuantized] = {}

    def dequantizing(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            prefix, _, last = name.rpartition(".")
            if last in ("input_scale", "input_zero_point"):
                continue  # NOTE: activations are quantized at run time, per row and group of 32
            if last == "weight_zero_point":
                raise ValueError(f"{name}: asymmetric weights are not read")
            if last not in ("weight", "weight_scale") or (last == "weight" and tensor.is_floating_point()):
                yield name, tensor
                continue
            parts = pending.setdefault(prefix, {})
            parts[last] = tensor
            if len(parts) == 2:
                del pending[prefix]
                values, scale = parts["weight"], parts["weight_scale"]
                if not self.keep:
                    yield f"{prefix}.weight", self._dequantized(prefix, values, scale)
                    continue
                weight = self._group_quantized(prefix, values, scale)
                self.quantized[f"{prefix}.weight".removeprefix("model.")] = weight
                yield f"{prefix}.weight", weight.dequantize()
        if pending:
            missing = ", ".join(f"{prefix}.{'weight' if 'weight_scale' in parts else 'weight_scale'}"
                                for prefix, parts in sorted(pending.items()))
            raise ValueError(f"quantized weights without their pair: {missing}")

    @staticmethod
    def _scales(prefix: str, values: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
        """The layer's scale for each output row and group of ``group`` inputs, [N, K / group],
        from a per-tensor, per-channel or per-group ``weight_scale``."""
        n, k = values.shape
        scale = scale.float().reshape(-1, 1) if scale.numel() in (1, n) else scale.float()
        scale = scale.expand(n, -1) if scale.shape[0] == 1 else scale
        if scale.shape[0] != n or (k // group) % scale.shape[1]:
            raise ValueError(f"{prefix}.weight_scale: shape {tuple(scale.shape)} does not fit a weight of "
                             f"{tuple(values.shape)}")
        return scale.repeat_interleave(k // group // scale.shape[1], dim=1)

    @classmethod
    def _dequantized(cls, prefix: str, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return values.float() * cls._scales(prefix, values, scale, 1)

    @classmethod
    def _group_quantized(cls, prefix: str, values: torch.Tensor, scale: torch.Tensor) -> GroupQuantized:
        if values.dtype != torch.int8 or values.dim() != 2:
            raise ValueError(f"{prefix}.weight: expected 8-bit integers [out, in], got {values.dtype} "
                             f"{tuple(values.shape)}")
        if values.shape[1] % GROUP:
            raise ValueError(f"{prefix}.weight: in_features {values.shape[1]} is not a multiple of {GROUP}")
        return GroupQuantized(values, float16_rounded(cls._scales(prefix, values, scale, GROUP)), None, 8)
