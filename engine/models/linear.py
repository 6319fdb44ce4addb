"""Linear layers whose weights are repacked once after loading, for bfloat16 on the CPU.

Three packings, chosen per machine by :func:`choose_packing`:

- ``"amx"``: Pagoda's own kernel (native/csrc/packed_linear.c) with AMX tiles
  (TDPBF16PS) for products of many rows and AVX512-BF16 for few, on CPUs where a tile
  product runs (proved by running one, not by the CPU's flags). The number of rows from
  which the tiles win is measured per weight shape when the weights are packed
  (:func:`amx_min_rows`: a few milliseconds a shape, kept on disk per CPU and kernel
  build). It beats oneDNN from 1 to 512 rows (docs/benchmarks.md), most of all at decode
  sizes.
- ``"blocked"``: the same kernel and layout with AVX512-BF16 only, on CPUs without AMX,
  and wherever batch invariance is asked for (the tiles sum in another order than the
  vectors). Weights in groups of 64 output features, input features paired, read once per
  tile of rows. On AVX512-BF16 CPUs without AMX it is faster than oneDNN at every batch size
  measured, most of all for small batches (decode).
- ``"onednn"``: oneDNN's blocked layout and its matrix products, elsewhere (CPUs without
  AVX512-BF16 have no use for the kernel).

``PAGODA_CPU_LINEAR=amx|blocked|onednn|none`` overrides the choice (for A/B measurements).

Quantized weights (engine/models/quantized.py: GGUF files' own types, ``--quantization int8``)
have their own packings, ``"q8"``, ``"q8m"``, ``"q4"`` and ``"q4m"`` (bits, "m": with
minimums), multiplied by csrc/quant_linear.c (``pagoda::quant_linear``), whatever the dtype.

Each :class:`Linear` hands its products to a :class:`LinearMethod` chosen once, when its weight
is packed or quantized (``method_for``): the weight as loaded, :class:`BlockedMethod`,
:class:`OneDNNMethod` or :class:`QuantizedMethod`; the tied LM head's packed copy has one too.

Each packing is an opaque op (``pagoda::blocked_linear``, ``pagoda::onednn_linear``, and
``pagoda::blocked_silu_mul_linear`` for :class:`GateUpLinear`; "amx" runs the blocked ops
with a row count from which they use the tiles) to torch.compile. NOTE:
defined with torch.library.Library, not @torch.library.custom_op, whose calls from compiled
code cost more (measured on one token: a compiled layer region 286 -> 270 µs, a single
stream's forward 18.0-18.7 -> 17.5-18.4 ms).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.environment import read, read_int
from pagoda.native import library as kernel_library
from pagoda.native import linear as linear_kernels
from pagoda.engine.models.quantized import QUANT_PACKINGS, GroupQuantized
from pagoda.engine.models.quantized import pack as pack_quantized

logger = logging.getLogger(__name__)

PACKING_ENV = "PAGODA_CPU_LINEAR"
QUANT_TILES_ENV = "PAGODA_QUANT_TILES_MIN_ROWS"  # replaces quant_amx_min_rows' measurement (0: never)
PACKINGS = ("amx", "blocked", "onednn")
BLOCKED_LAYOUT = ("amx", "blocked")  # the packings with csrc/packed_linear.c's layout and kernel

_library = torch.library.Library("pagoda", "FRAGMENT")
_library.define("blocked_linear(Tensor x, Tensor weight, Tensor? bias, int out_features, int amx_min_rows) -> Tensor")
_library.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_library.define("blocked_silu_mul_linear(Tensor x, Tensor weight, int intermediate_size, int amx_min_rows) -> Tensor")
_library.define("quant_linear(Tensor x, Tensor weight, Tensor? bias, int out_features, int bits, bool has_min, "
                "bool out_f32, int amx_min_rows) -> Tensor")
_library.define("quant_silu_mul_linear(Tensor x, Tensor weight, int intermediate_size, int bits, bool has_min, "
                "int amx_min_rows) -> Tensor")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


_library.impl("blocked_linear", linear_kernels.packed_linear, "CompositeExplicitAutograd")
_library.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")
_library.impl("blocked_silu_mul_linear", linear_kernels.packed_silu_mul_linear, "CompositeExplicitAutograd")
_library.impl("quant_linear", linear_kernels.quant_linear, "CompositeExplicitAutograd")
_library.impl("quant_silu_mul_linear", linear_kernels.quant_silu_mul_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("pagoda::blocked_linear")
def _(x, weight, bias, out_features, amx_min_rows):
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("pagoda::onednn_linear")
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("pagoda::blocked_silu_mul_linear")
def _(x, weight, intermediate_size, amx_min_rows):
    return x.new_empty(x.shape[0], intermediate_size)


@torch.library.register_fake("pagoda::quant_linear")
def _(x, weight, bias, out_features, bits, has_min, out_f32, amx_min_rows):
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32 if out_f32 else x.dtype)


@torch.library.register_fake("pagoda::quant_silu_mul_linear")
def _(x, weight, intermediate_size, bits, has_min, amx_min_rows):
    return x.new_empty(x.shape[0], intermediate_size)


@functools.cache
def _has_amx() -> bool:
    return " amx_bf16" in kernel_library.cpu_flags()


def packing_available(packing: str) -> bool:
    """Whether this machine can run ``packing`` (one of PACKINGS)."""
    if packing == "blocked":
        return linear_kernels.packed_linear_available()
    if packing == "amx":
        return linear_kernels.packed_linear_amx_available()
    # NOTE: oneDNN's bfloat16 products need AVX512-BW/VL/DQ or AVX-NE-CONVERT, as oneDNN
    # itself reports them (ONEDNN_MAX_CPU_ISA lowers it); without them the reorder raises.
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def choose_packing(device: torch.device, dtype: torch.dtype, batch_invariant: bool = False) -> str | None:
    """The packing for linear weights on this machine, or None to keep them as loaded.

    With ``batch_invariant``, Pagoda's kernel, whose every output row is summed in the same
    order whatever the number of rows: on AMX tiles for every row where they run ("amx",
    packed with ``batch_invariant`` so that no row count switches to the vectors), else
    with AVX512-BF16 ("blocked"). oneDNN's small-batch products round differently from its
    large-batch ones.

    Raises:
        ValueError: PAGODA_CPU_LINEAR names an unknown packing, or one this machine lacks;
            batch invariance where the blocked kernel cannot run.
    """
    if batch_invariant:
        if device.type != "cpu" or dtype != torch.bfloat16 or not packing_available("blocked"):
            raise ValueError("batch_invariant needs bfloat16 on a CPU with AVX512-BF16 (Pagoda's blocked matrix "
                             f"kernel); this is {device.type} in {str(dtype).removeprefix('torch.')}"
                             + ("" if packing_available("blocked") else ", without the kernel"))
        requested = read(PACKING_ENV)
        if requested in BLOCKED_LAYOUT and packing_available(requested):
            return requested  # NOTE: both are invariant; the override picks one to test it
        return "amx" if packing_available("amx") else "blocked"
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    requested = read(PACKING_ENV)
    if requested:
        if requested == "none":
            return None
        if requested not in PACKINGS:
            raise ValueError(f"{PACKING_ENV}={requested!r}: expected one of {', '.join(PACKINGS)} or none")
        if not packing_available(requested):
            raise ValueError(f"{PACKING_ENV}={requested}: not available on this machine")
        return requested
    if packing_available("amx"):
        return "amx"
    # NOTE: a CPU that lists AMX but whose tiles did not run: oneDNN decides for itself.
    if not _has_amx() and packing_available("blocked"):
        return "blocked"
    return "onednn" if packing_available("onednn") else None


def pack_weight(weight: torch.Tensor, packing: str) -> torch.Tensor:
    """A [out, in] weight repacked for ``packing``."""
    with torch.no_grad():
        if packing in BLOCKED_LAYOUT:
            return linear_kernels.pack_linear_weight(weight.detach())
        # NOTE: 64 is oneDNN's batch-size hint; the layout it picks was the same for 1 and 64.
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


# -- how a layer's weight is multiplied -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LinearMethod:
    """How one linear layer's weight is held and multiplied, chosen once at load (the pattern of
    vLLM's ``quant_method``): the layer keeps its weight and bias and hands every product to its
    method, so that a family's file says nothing of storage. This base is the weight as loaded
    (torch's product); the subclasses are the packings of :func:`choose_packing` and the
    quantized ones.

    Attributes:
        packing: The packing's name (None: as loaded), which the compiled regions' cache key
            and the one-call forward read.
        amx_min_rows: The rows from which the product runs on AMX tiles (0: never).
    """

    packing: str | None = None
    amx_min_rows: int = 0

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              out_features: int) -> torch.Tensor:
        """x @ W.T + bias, in x's dtype."""
        return F.linear(x, weight, bias)

    def logits(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        """The product as an LM head's: float32 sums where Pagoda's kernels run them, never
        rounded to bfloat16 (at bfloat16's resolution near candidates tie: the default model's
        answer to "What is the capital of France?" went astray on such a tie); else in x's dtype
        (the caller then breaks bfloat16 ties, decoder.break_bfloat16_ties)."""
        return self.apply(x, weight, bias, out_features)

    def greedy_tokens(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor | None:
        """Each row's greedy token from an LM head's product without writing its logits (the first
        of the largest of :meth:`logits`), where a kernel does that; else None (the caller takes
        the logits)."""
        return None

    def silu_mul(self, x: torch.Tensor, weight: torch.Tensor, intermediate_size: int) -> torch.Tensor:
        """SiLU(gate) * up of a gate/up product (gate's features, then up's)."""
        gate, up = self.apply(x, weight, None, 2 * intermediate_size).split(intermediate_size, dim=-1)
        return F.silu(gate) * up


AS_LOADED = LinearMethod()


@dataclasses.dataclass(frozen=True)
class BlockedMethod(LinearMethod):
    """Pagoda's bfloat16 kernel (csrc/packed_linear.c) over a weight from pack_weight ("amx",
    "blocked"); with ``fused_silu_mul``, a gate/up weight from pack_silu_mul_weight, whose
    activation runs in the kernel's epilogue (:meth:`silu_mul` only)."""

    fused_silu_mul: bool = False

    def apply(self, x, weight, bias, out_features):
        assert not self.fused_silu_mul, "a fused gate/up weight has only silu_mul"
        return torch.ops.pagoda.blocked_linear(x, weight, bias, out_features, self.amx_min_rows)

    def logits(self, x, weight, bias, out_features):
        return linear_kernels.packed_linear(x if x.is_contiguous() else x.contiguous(), weight, bias, out_features,
                                            self.amx_min_rows, out_dtype=torch.float32)

    def silu_mul(self, x, weight, intermediate_size):
        if not self.fused_silu_mul:
            return super().silu_mul(x, weight, intermediate_size)
        return torch.ops.pagoda.blocked_silu_mul_linear(x, weight, intermediate_size, self.amx_min_rows)


@dataclasses.dataclass(frozen=True)
class OneDNNMethod(LinearMethod):
    """oneDNN's blocked layout and products (a weight from pack_weight(W, "onednn"))."""

    def apply(self, x, weight, bias, out_features):
        return torch.ops.pagoda.onednn_linear(x, weight, bias)


@dataclasses.dataclass(frozen=True)
class QuantizedMethod(LinearMethod):
    """A quantized weight (engine/models/quantized.py's pack) on csrc/quant_linear.c: its
    integer vectors, and on AMX tiles from ``amx_min_rows`` (Linear.tile_quantized)."""

    @property
    def bits_and_min(self) -> tuple[int, bool]:
        return QUANT_PACKINGS[self.packing]

    def apply(self, x, weight, bias, out_features):
        return torch.ops.pagoda.quant_linear(x, weight, bias, out_features, *self.bits_and_min, False,
                                             self.amx_min_rows)

    def logits(self, x, weight, bias, out_features):
        return linear_kernels.quant_linear(x, weight, bias, out_features, *self.bits_and_min, out_f32=True,
                                           amx_min_rows=self.amx_min_rows)

    def greedy_tokens(self, x, weight, bias, out_features):
        return linear_kernels.quant_linear_argmax(x, weight, bias, out_features, *self.bits_and_min,
                                                  amx_min_rows=self.amx_min_rows)

    def silu_mul(self, x, weight, intermediate_size):
        if not self.amx_min_rows:  # NOTE: the fused activation is the tile path's
            return super().silu_mul(x, weight, intermediate_size)
        return torch.ops.pagoda.quant_silu_mul_linear(x, weight, intermediate_size, *self.bits_and_min,
                                                      self.amx_min_rows)


def method_for(packing: str | None, amx_min_rows: int = 0, fused_silu_mul: bool = False) -> LinearMethod:
    """The method that multiplies a weight packed for ``packing`` (None: as loaded)."""
    if packing is None:
        return AS_LOADED
    if packing in BLOCKED_LAYOUT:
        return BlockedMethod(packing, amx_min_rows, fused_silu_mul)
    if packing in QUANT_PACKINGS:
        return QuantizedMethod(packing, amx_min_rows)
    if packing == "onednn":
        return OneDNNMethod(packing)
    raise ValueError(f"unknown packing {packing!r}")


# -- where the tiles take over ---------------------------------------------------------------

CALIBRATION_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
QUANT_CALIBRATION_ROWS = (16, 32, 48, 64, 96, 128)  # the quantized kernel's tiles win later than bfloat16's
_amx_rows: dict[str, int] = {}
calibration_seconds = 0.0  # spent measuring in this process (reported at start-up)


def _calibration_file() -> str:
    """Where measured thresholds are kept: beside the kernel library they were measured with
    (its name is a hash of the source, the compiler and the CPU's flags)."""
    return str(kernel_library.library_path().with_suffix(".amx_rows.json"))


def _time(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def amx_min_rows(weight: torch.Tensor, out_features: int, fused_silu_mul: bool = False) -> int:
    """The fewest rows from which ``weight`` (packed for "amx") is multiplied faster on AMX
    tiles than with AVX512-BF16, measured on this weight: the smallest of CALIBRATION_ROWS
    from which the tiles win at every larger one tried (past them: the last, where the
    tiles always win by far). Measured once per weight shape and kept on disk (a later start
    reads the number); a few milliseconds a shape.
    """
    k = weight.shape[1] * 2
    op = torch.ops.pagoda.blocked_silu_mul_linear if fused_silu_mul else torch.ops.pagoda.blocked_linear
    args = (out_features // 2,) if fused_silu_mul else (None, out_features)
    return _calibrated(f"{out_features}x{k}" + ("+silu_mul" if fused_silu_mul else ""), k, CALIBRATION_ROWS,
                       lambda x, rows: op(x, weight, *args, rows))


def tile_rows(weight: torch.Tensor, out_features: int, packing: str, batch_invariant: bool,
              fused_silu_mul: bool = False) -> int:
    """Where a weight packed for ``packing`` goes on AMX tiles: never (0) but with "amx"; there
    from the first row with ``batch_invariant`` (each row's sums then run in one order whatever
    the batch), else from :func:`amx_min_rows`' measurement."""
    if packing != "amx":
        return 0
    return 1 if batch_invariant else amx_min_rows(weight, out_features, fused_silu_mul)


def quant_amx_min_rows(weight: torch.Tensor, packing: str, out_features: int, in_features: int,
                       fused_silu_mul: bool = False) -> int:
    """As :func:`amx_min_rows` for a quantized weight (``packing`` one of QUANT_PACKINGS): the
    fewest rows from which the quantized kernel's tile path (the weight dequantized to
    bfloat16 a chunk at a time, csrc/quant_linear.c) beats its integer vectors, tried at
    QUANT_CALIBRATION_ROWS (32 for SmolLM2's Q4_1 layers on an Intel Xeon with AMX)."""
    bits, has_min = QUANT_PACKINGS[packing]
    if fused_silu_mul:
        def product(x, rows):
            return linear_kernels.quant_silu_mul_linear(x, weight, out_features // 2, bits, has_min, rows)
    else:
        def product(x, rows):
            return linear_kernels.quant_linear(x, weight, None, out_features, bits, has_min, amx_min_rows=rows)
    key = f"{out_features}x{in_features}+{packing}" + ("+silu_mul" if fused_silu_mul else "")
    return _calibrated(key, in_features, QUANT_CALIBRATION_ROWS, product)


def quant_tile_rows(weight: torch.Tensor, packing: str, out_features: int, in_features: int,
                    fused_silu_mul: bool = False) -> int:
    """quant_amx_min_rows, or the count $PAGODA_QUANT_TILES_MIN_ROWS gives instead (0: never)."""
    rows = read_int(QUANT_TILES_ENV)
    if rows is not None:
        return rows
    return quant_amx_min_rows(weight, packing, out_features, in_features, fused_silu_mul)


def _calibrated(key: str, k: int, candidates: tuple[int, ...], product) -> int:
    """The smallest of ``candidates`` from which ``product(x, rows)`` (rows: where the tiles
    take over, 0 never) is faster on the tiles at every larger candidate, from the file of
    earlier measurements or measured now."""
    if key in _amx_rows:
        return _amx_rows[key]
    path = _calibration_file()
    try:
        with open(path) as f:
            _amx_rows.update(json.load(f))
    except (OSError, ValueError):
        pass
    if key in _amx_rows:
        return _amx_rows[key]
    global calibration_seconds
    start = time.perf_counter()
    x = torch.randn(candidates[-1], k, dtype=torch.bfloat16)
    wins = [_time(lambda: product(x[:rows], rows)) < _time(lambda: product(x[:rows], 0)) for rows in candidates]
    rows = candidates[-1]
    for candidate, win in zip(reversed(candidates), reversed(wins)):
        if not win:
            break
        rows = candidate
    _amx_rows[key] = rows
    calibration_seconds += time.perf_counter() - start
    # NOTE: written to a temporary file and renamed, so that workers starting together never
    # read half a file; the last writer's measurements win.
    try:
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump(_amx_rows, f)
        os.replace(tmp, path)
    except OSError as exc:
        logger.info("could not keep the AMX calibration in %s: %s", path, exc)
    return rows


def describe_amx_rows(model: nn.Module) -> str:
    """The range of amx_min_rows over a model's layers on AMX tiles (the "amx" packing's, the
    quantized ones' from tile_quantized), e.g. "2-4"."""
    rows = sorted({module.amx_min_rows for module in model.modules() if getattr(module, "amx_min_rows", 0)})
    if not rows:
        return "-"
    return str(rows[0]) if rows[0] == rows[-1] else f"{rows[0]}-{rows[-1]}"


class Linear(nn.Linear):
    """nn.Linear whose weight can be repacked (see choose_packing) or quantized after loading;
    its :class:`LinearMethod` multiplies it."""

    method: LinearMethod = AS_LOADED
    # The layer's LoRA slots (engine/models/lora.py) with --enable-lora; None: not adapted.
    lora = None

    @property
    def packing(self) -> str | None:
        return self.method.packing

    @property
    def amx_min_rows(self) -> int:
        return self.method.amx_min_rows

    def pack(self, packing: str, batch_invariant: bool = False) -> None:
        """Repacks the weight for ``packing``; "amx" measures where the tiles take over, or
        with ``batch_invariant`` takes them for every row (each row's sums then run in one
        order whatever the batch)."""
        self.weight = nn.Parameter(pack_weight(self.weight, packing), requires_grad=False)
        self.method = method_for(packing, tile_rows(self.weight, self.out_features, packing, batch_invariant))

    def quantize(self, weight: GroupQuantized) -> None:
        """Replaces the float weight by ``weight`` (for this layer's [out, in] shape),
        multiplied by the quantized kernel from now on; a bias becomes float32."""
        assert weight.shape == (self.out_features, self.in_features), (weight.shape, self.weight.shape)
        self.weight = nn.Parameter(pack_quantized(weight), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().float(), requires_grad=False)
        self.method = method_for(weight.packing)

    def tile_quantized(self) -> None:
        """On a CPU whose AMX tiles run, a quantized weight's products of many rows on them
        (from the measured quant_amx_min_rows; not with a bias, which that path lacks)."""
        if self.packing not in QUANT_PACKINGS or self.bias is not None:
            return
        self.method = method_for(self.packing, quant_tile_rows(self.weight, self.packing, self.out_features,
                                                               self.in_features,
                                                               fused_silu_mul=isinstance(self, GateUpLinear)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(x, self.weight, self.bias, self.out_features)
        if self.lora is not None and self.lora.context.groups:
            return self.lora.add_delta(x, out)
        return out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The product as an LM head's (LinearMethod.logits): float32 where the kernel runs."""
        return self.method.logits(x, self.weight, self.bias, self.out_features)

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """The LM head's greedy token per row without its logits (LinearMethod.greedy_tokens), or None."""
        return self.method.greedy_tokens(x, self.weight, self.bias, self.out_features)


class GateUpLinear(Linear):
    """gate_proj and up_proj of a gated MLP as one product (weight: gate's rows, then up's),
    returning SiLU(gate) * up.

    With the "blocked" packing the activation runs in the kernel's epilogue, so the product
    twice as wide as the result never goes to memory (csrc/packed_linear.c). Not with LoRA
    slots, whose delta joins the product before the activation.
    """

    def pack(self, packing: str, batch_invariant: bool = False) -> None:
        # NOTE: quantized weights are not packed again
        if packing not in BLOCKED_LAYOUT or self.lora is not None:
            return super().pack(packing, batch_invariant)
        assert self.bias is None, "the fused kernel has no bias"
        with torch.no_grad():
            self.weight = nn.Parameter(linear_kernels.pack_silu_mul_weight(self.weight.detach()), requires_grad=False)
        rows = tile_rows(self.weight, self.out_features, packing, batch_invariant, fused_silu_mul=True)
        self.method = method_for(packing, rows, fused_silu_mul=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        intermediate_size = self.out_features // 2
        if self.lora is not None:  # NOTE: rounded once, as the compiled regions and the one-call forward round it
            gate, up = super().forward(x).float().split(intermediate_size, dim=-1)
            return (F.silu(gate) * up).to(x.dtype)
        return self.method.silu_mul(x, self.weight, intermediate_size)
