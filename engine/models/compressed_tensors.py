"""Checkpoints quantized in the compressed-tensors format (llm-compressor's, which vLLM serves):
8-bit integer weights (W8A8 and W8A16, ``int-quantized`` / ``naive-quantized``).

Such a checkpoint's ``config.json`` has a ``quantization_config`` with ``quant_method``
``compressed-tensors``; each quantized linear layer stores ``weight`` as int8 [N, K] and
``weight_scale`` (per output channel [N, 1], per tensor, or per group of inputs [N, K / g]),
so that ``w = weight_scale * weight``; static activation scales (``input_scale``) may be
there too. Pagoda reads the integers as they are into :class:`GroupQuantized` (the form
csrc/quant_linear.c multiplies: a scale per group of 32 inputs, here the layer's scale
repeated, rounded to float16: a relative error under 2^-11) and quantizes activations itself,
per row and group of 32 at run time (finer than the per-token or static scales the checkpoint
was calibrated with; a static ``input_scale`` is not used). Where the quantized kernel does not
run (EngineConfig.quantization ``none``, a GPU, no AVX512-VNNI), the weights are dequantized.

Other compressed-tensors schemes (4-bit ``pack-quantized``, fp8 ``float-quantized``,
asymmetric weights with zero points, 2:4 sparsity) fail with an error that names them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from pagoda.engine.models.quantized import GROUP, GroupQuantized, float16_rounded

METHOD = "compressed-tensors"
FORMATS = ("int-quantized", "naive-quantized")
STRATEGIES = ("channel", "tensor", "group")


def quantization_config(model_dir: Path) -> dict | None:
    """The checkpoint's quantization_config when its method is compressed-tensors, else None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    quantization = config.get("quantization_config") or {}
    return quantization if quantization.get("quant_method") == METHOD else None


def check_scheme(quantization: dict) -> str:
    """A short description of a compressed-tensors config Pagoda reads ("W8A8 int8, per
    channel"), or ValueError naming what it does not read."""
    def fail(what: str) -> ValueError:
        return ValueError(f"this compressed-tensors checkpoint has {what}, which Pagoda does not read; it reads "
                          "8-bit integer weights (int-quantized/naive-quantized, symmetric, per channel, tensor or "
                          "group of a multiple of 32): use its bf16/fp16 checkpoint or a GGUF file otherwise")

    if quantization.get("sparsity_config"):
        raise fail("a sparsity config")
    status = quantization.get("quantization_status", "compressed")
    if status != "compressed":
        raise fail(f"quantization_status {status!r}")
    groups = quantization.get("config_groups") or {}
    if not groups:
        raise fail("no config_groups")
    schemes = set()
    for name, group in groups.items():
        group_format = group.get("format") or quantization.get("format")
        if group_format not in FORMATS:
            raise fail(f"the format {group_format!r} (group {name})")
        weights = group.get("weights") or {}
        if (weights.get("type"), weights.get("num_bits")) != ("int", 8):
            raise fail(f"{weights.get('num_bits')}-bit {weights.get('type')} weights (group {name})")
        if not weights.get("symmetric", True):
            raise fail(f"asymmetric weights with zero points (group {name})")
        strategy = weights.get("strategy")
        if strategy not in STRATEGIES:
            raise fail(f"weights quantized per {strategy} (group {name})")
        if strategy == "group" and (weights.get("group_size") or 0) % GROUP:
            raise fail(f"a group size of {weights.get('group_size')} (group {name})")
        if weights.get("dynamic"):
            raise fail(f"dynamic weight scales (group {name})")
        activations = group.get("input_activations")
        if activations and (activations.get("type"), activations.get("num_bits")) != ("int", 8):
            raise fail(f"{activations.get('num_bits')}-bit {activations.get('type')} activations (group {name})")
        by = f"per {strategy}" + (f" of {weights['group_size']}" if strategy == "group" else "")
        schemes.add(f"W8A{'8' if activations else '16'} int8 weights {by}")
    return "; ".join(sorted(schemes))


class CompressedTensorsCheckpoint:
    """Reads a compressed-tensors checkpoint's tensors: :meth:`dequantizing` passes the float
    tensors on and turns each quantized layer's integers into a float weight, keeping them in
    :attr:`quantized` (checkpoint name, "model." dropped -> GroupQuantized) on the way."""

    def __init__(self, quantization: dict) -> None:
        self.description = check_scheme(quantization)
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
                weight = self._group_quantized(prefix, parts["weight"], parts["weight_scale"])
                self.quantized[f"{prefix}.weight".removeprefix("model.")] = weight
                yield f"{prefix}.weight", weight.dequantize()
        if pending:
            missing = ", ".join(f"{prefix}.{'weight' if 'weight_scale' in parts else 'weight_scale'}"
                                for prefix, parts in sorted(pending.items()))
            raise ValueError(f"quantized weights without their pair: {missing}")

    @staticmethod
    def _group_quantized(prefix: str, values: torch.Tensor, scale: torch.Tensor) -> GroupQuantized:
        if values.dtype != torch.int8 or values.dim() != 2:
            raise ValueError(f"{prefix}.weight: expected 8-bit integers [out, in], got {values.dtype} "
                             f"{tuple(values.shape)}")
        n, k = values.shape
        if k % GROUP:
            raise ValueError(f"{prefix}.weight: in_features {k} is not a multiple of {GROUP}")
        scale = scale.float().reshape(-1, 1) if scale.numel() in (1, n) else scale.float()
        scale = scale.expand(n, -1) if scale.shape[0] == 1 else scale
        if scale.shape[0] != n or (k // GROUP) % scale.shape[1]:
            raise ValueError(f"{prefix}.weight_scale: shape {tuple(scale.shape)} does not fit a weight of "
                             f"{tuple(values.shape)}")
        scales = scale.repeat_interleave(k // GROUP // scale.shape[1], dim=1)
        return GroupQuantized(values, float16_rounded(scales), None, 8)
