"""Linear layers whose weights are repacked once after loading, for bfloat16 on the CPU.

Two packings, chosen per machine by :func:`choose_packing`:

- ``"blocked"``: Pagoda's own kernel (attention_backends/csrc/packed_linear.c) on CPUs
  with AVX512-BF16 and no AMX. Weights in groups of 64 output features, input features
  paired, read once per tile of rows. It is the faster of the two for every batch size
  measured on this machine (docs/benchmarks.md), most of all for small batches (decode),
  which oneDNN runs at about half the memory bandwidth.
- ``"onednn"``: oneDNN's blocked layout and its matrix products, elsewhere (AMX runs
  prefills faster through oneDNN, and CPUs without AVX512-BF16 have no use for the
  kernel).

``PAGODA_CPU_LINEAR=blocked|onednn|none`` overrides the choice (for A/B measurements).

Each packing is an opaque op (``pagoda::blocked_linear``, ``pagoda::onednn_linear``, and
``pagoda::blocked_silu_mul_linear`` for :class:`GateUpLinear`) to torch.compile. NOTE:
defined with torch.library.Library, not @torch.library.custom_op, whose calls from compiled
code cost more (measured on one token: a compiled layer region 286 -> 270 µs, a single
stream's forward 18.0-18.7 -> 17.5-18.4 ms).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention_backends import cpu_kernels

PACKING_ENV = "PAGODA_CPU_LINEAR"
PACKINGS = ("blocked", "onednn")

_library = torch.library.Library("pagoda", "FRAGMENT")
_library.define("blocked_linear(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor")
_library.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_library.define("blocked_silu_mul_linear(Tensor x, Tensor weight, int intermediate_size) -> Tensor")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


_library.impl("blocked_linear", cpu_kernels.packed_linear, "CompositeExplicitAutograd")
_library.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")
_library.impl("blocked_silu_mul_linear", cpu_kernels.packed_silu_mul_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("pagoda::blocked_linear")
def _(x, weight, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("pagoda::onednn_linear")
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("pagoda::blocked_silu_mul_linear")
def _(x, weight, intermediate_size):
    return x.new_empty(x.shape[0], intermediate_size)


@functools.cache
def _has_amx() -> bool:
    return " amx_bf16" in cpu_kernels.cpu_flags()


def packing_available(packing: str) -> bool:
    """Whether this machine can run ``packing`` (one of PACKINGS)."""
    if packing == "blocked":
        return cpu_kernels.packed_linear_available()
    # NOTE: oneDNN's bfloat16 products need AVX512-BW/VL/DQ or AVX-NE-CONVERT, as oneDNN
    # itself reports them (ONEDNN_MAX_CPU_ISA lowers it); without them the reorder raises.
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def choose_packing(device: torch.device, dtype: torch.dtype, batch_invariant: bool = False) -> str | None:
    """The packing for linear weights on this machine, or None to keep them as loaded.

    With ``batch_invariant``, the blocked kernel, whose every output row is summed in the
    same order whatever the number of rows (oneDNN's small-batch products round
    differently from its large-batch ones).

    Raises:
        ValueError: PAGODA_CPU_LINEAR names an unknown packing, or one this machine lacks;
            batch invariance where the blocked kernel cannot run.
    """
    if batch_invariant:
        if device.type != "cpu" or dtype != torch.bfloat16 or not packing_available("blocked"):
            raise ValueError("batch_invariant needs bfloat16 on a CPU with AVX512-BF16 (Pagoda's blocked matrix "
                             f"kernel); this is {device.type} in {str(dtype).removeprefix('torch.')}"
                             + ("" if packing_available("blocked") else ", without the kernel"))
        return "blocked"
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    requested = os.environ.get(PACKING_ENV)
    if requested:
        if requested == "none":
            return None
        if requested not in PACKINGS:
            raise ValueError(f"{PACKING_ENV}={requested!r}: expected one of {', '.join(PACKINGS)} or none")
        if not packing_available(requested):
            raise ValueError(f"{PACKING_ENV}={requested}: not available on this machine")
        return requested
    if not _has_amx() and packing_available("blocked"):
        return "blocked"
    return "onednn" if packing_available("onednn") else None


def pack_weight(weight: torch.Tensor, packing: str) -> torch.Tensor:
    """A [out, in] weight repacked for ``packing``."""
    with torch.no_grad():
        if packing == "blocked":
            return cpu_kernels.pack_linear_weight(weight.detach())
        # NOTE: 64 is oneDNN's batch-size hint; the layout it picks was the same for 1 and 64.
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packing: str,
                  out_features: int) -> torch.Tensor:
    """x @ W.T + bias for a weight from pack_weight(W, packing)."""
    if packing == "blocked":
        return torch.ops.pagoda.blocked_linear(x, weight, bias, out_features)
    return torch.ops.pagoda.onednn_linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose weight can be repacked (see choose_packing) after loading."""

    packing: str | None = None

    def pack(self, packing: str) -> None:
        self.weight = nn.Parameter(pack_weight(self.weight, packing), requires_grad=False)
        self.packing = packing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packing is not None:
            return packed_linear(x, self.weight, self.bias, self.packing, self.out_features)
        return F.linear(x, self.weight, self.bias)


class GateUpLinear(Linear):
    """gate_proj and up_proj of a gated MLP as one product (weight: gate's rows, then up's),
    returning SiLU(gate) * up.

    With the "blocked" packing the activation runs in the kernel's epilogue, so the product
    twice as wide as the result never goes to memory (csrc/packed_linear.c).
    """

    def pack(self, packing: str) -> None:
        if packing != "blocked":
            return super().pack(packing)
        assert self.bias is None, "the fused kernel has no bias"
        with torch.no_grad():
            self.weight = nn.Parameter(cpu_kernels.pack_silu_mul_weight(self.weight.detach()), requires_grad=False)
        self.packing = packing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        intermediate_size = self.out_features // 2
        if self.packing == "blocked":
            return torch.ops.pagoda.blocked_silu_mul_linear(x, self.weight, intermediate_size)
        gate, up = super().forward(x).split(intermediate_size, dim=-1)
        return F.silu(gate) * up
