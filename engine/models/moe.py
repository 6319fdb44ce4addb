"""A mixture-of-experts MLP: a router picks each token's top k experts, each expert is a SwiGLU
MLP, and a token's output is the routing-weighted sum of its experts' outputs.

The step's tokens are grouped by expert (one sort of the token-expert pairs), and each expert
that got tokens multiplies its rows at once: the loop runs over experts, never over tokens or
requests, and an expert that got no token this step costs nothing. The experts' weights are
stacked ([experts, 2 x intermediate, hidden] for gate and up, [experts, hidden, intermediate]
for down); under tensor parallelism each rank holds every expert's share of the intermediate
width, so the layer's output is a partial sum that the decoder layer all-reduces as it does a
dense MLP's.

The grouped product is one opaque op to torch.compile (its loop depends on the routing, data,
which would break the compiled region's graph): ``pagoda::moe_experts`` with the experts as
loaded (torch's products); ``pagoda::moe_experts_native``, one C call for the whole layer but
the router's product (csrc/one_call_forward.c: the routing, the grouping, each expert's
products, the weighted sum; the one-call forward runs the same function), with each
expert packed for Pagoda's bfloat16 kernel (csrc/packed_linear.c: gate and up in one product with
SiLU(gate) * up in its epilogue, on AMX tiles from the measured row count), as every other
linear layer of the model is on a CPU with AVX512-BF16, or quantized (a GGUF file's own blocks,
or ``--quantization int8``) for csrc/quant_linear.c; ``pagoda::moe_experts_quantized``, the
quantized experts with float32 activations, which the C call does not take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.native import linear as linear_kernels
from pagoda.engine.models.linear import BLOCKED_LAYOUT, Linear, tile_rows
from pagoda.engine.models.quantized import QUANT_PACKINGS, GroupQuantized
from pagoda.engine.models.quantized import pack as pack_quantized

_library = torch.library.Library("pagoda", "FRAGMENT")
_library.define("moe_experts(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, Tensor down) -> Tensor")
_library.define("moe_experts_native(Tensor x, Tensor logits, Tensor gate_up, Tensor down, int top_k, "
                "bool norm_topk_prob, int intermediate, int gate_up_kind, int gate_up_a, int gate_up_b, "
                "int down_kind, int down_a, int down_b) -> Tensor")
_library.define("moe_experts_quantized(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, Tensor down, "
                "int intermediate, int gate_up_bits, bool gate_up_has_min, int down_bits, bool down_has_min) -> Tensor")


def _grouped(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, num_experts: int, expert) -> torch.Tensor:
    """sum_j weights[t, j] * expert(e, x[rows of e]) over each token t's experts e = experts[t, j],
    each expert that got tokens called once on all of its rows."""
    out = torch.zeros_like(x)
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)  # NOTE: stable, so each expert's tokens stay in order
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # one read-back a layer
    tokens = order // k
    pair_weights = weights.reshape(-1)[order].unsqueeze(1)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        rows = tokens[start:start + count]
        out.index_add_(0, rows, expert(e, x.index_select(0, rows)) * pair_weights[start:start + count])
        start += count
    return out


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) for every token t.

    Args:
        x: [tokens, hidden].
        experts: [tokens, k] int64, each token's experts.
        weights: [tokens, k] in x's dtype, their routing weights.
        gate_up: [num_experts, 2 * intermediate, hidden], gate's rows then up's.
        down: [num_experts, hidden, intermediate].
    """
    intermediate = down.shape[2]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, gate_up[e]).split(intermediate, dim=-1)
        return F.linear(F.silu(gate) * up, down[e])

    return _grouped(x, experts, weights, gate_up.shape[0], expert)


def moe_experts_native(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                       norm_topk_prob: bool, intermediate: int, gate_up_kind: int, gate_up_a: int, gate_up_b: int,
                       down_kind: int, down_a: int, down_b: int) -> torch.Tensor:
    """The routing (from the router's bfloat16 ``logits``) and moe_experts in one C call
    (csrc/one_call_forward.c's moe_layer_forward, which the one-call forward runs too) over
    experts packed for Pagoda's kernels (SparseMoE.pack's bfloat16 ones, SparseMoE.quantize's),
    bfloat16 ``x``; ``*_kind``, ``*_a``, ``*_b``: the kernel's description of each expert's
    product (SparseMoE.products). Each token's experts are summed in float32 and rounded once."""
    return linear_kernels.moe_layer(x, logits, linear_kernels.moe_layer_struct(
        gate_up, (gate_up_kind, gate_up_a, gate_up_b), down, (down_kind, down_a, down_b), intermediate, top_k,
        norm_topk_prob))


def moe_experts_quantized(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor, intermediate: int, gate_up_bits: int, gate_up_has_min: bool,
                          down_bits: int, down_has_min: bool) -> torch.Tensor:
    """moe_experts with quantized experts (SparseMoE.quantize): ``gate_up`` and ``down``
    [experts, bytes] each expert's weight packed by engine/models/quantized.py, multiplied by
    csrc/quant_linear.c's vectors (its tiles are not used for experts yet)."""
    hidden = x.shape[1]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = linear_kernels.quant_linear(rows, gate_up[e], None, 2 * intermediate, gate_up_bits,
                                               gate_up_has_min).split(intermediate, dim=-1)
        return linear_kernels.quant_linear(F.silu(gate) * up, down[e], None, hidden, down_bits, down_has_min)

    return _grouped(x, experts, weights, gate_up.shape[0], expert)


_library.impl("moe_experts", moe_experts, "CompositeExplicitAutograd")
_library.impl("moe_experts_native", moe_experts_native, "CompositeExplicitAutograd")
_library.impl("moe_experts_quantized", moe_experts_quantized, "CompositeExplicitAutograd")


@torch.library.register_fake("pagoda::moe_experts")
def _(x, experts, weights, gate_up, down):
    return torch.empty_like(x)


@torch.library.register_fake("pagoda::moe_experts_native")
def _(x, logits, gate_up, down, top_k, norm_topk_prob, intermediate, gate_up_kind, gate_up_a, gate_up_b, down_kind,
      down_a, down_b):
    return torch.empty_like(x)


@torch.library.register_fake("pagoda::moe_experts_quantized")
def _(x, experts, weights, gate_up, down, intermediate, gate_up_bits, gate_up_has_min, down_bits, down_has_min):
    return torch.empty_like(x)


class RouterLinear(Linear):
    """A router's product: packed like any linear layer, never quantized (a token's experts
    change with small errors in its logits)."""


class SparseMoE(nn.Module):
    """The router (``gate``, replicated on every rank) and the stacked experts of one layer.

    Args:
        hidden_size: The residual stream's width.
        num_experts: Experts of the layer.
        top_k: Experts per token.
        intermediate_size: This rank's share of each expert's intermediate width.
        norm_topk_prob: Whether the top k weights are renormalized to sum to 1.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate = RouterLinear(hidden_size, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.intermediate_size = intermediate_size
        # "amx"/"blocked" once pack() ran: the packed experts; "q4m+q8" (gate/up's, down's)
        # once quantize() ran.
        self.packing: str | None = None
        self.tile_rows = (0, 0)  # gate/up's and down's rows from which the tiles run
        # With quantized experts: (bits, has_min) of gate/up's, then down's.
        self.quantized: tuple[tuple[int, bool], tuple[int, bool]] | None = None
        # Once packed or quantized: the C kernel's (kind, a, b) of every expert's gate/up product,
        # then of its down product (csrc/one_call_forward.c's struct layer_product).
        self.products: tuple[int, ...] | None = None

    def quantize(self, gate_up: list[GroupQuantized], down: list[GroupQuantized]) -> None:
        """Replaces the float experts by quantized ones, one weight an expert for each product
        (gate/up's rows fused as gate then up), multiplied by the quantized kernel from now on.

        Raises:
            ValueError: Not one weight per expert, a weight of another shape, or experts
                quantized in different packings (they are stacked in one tensor).
        """
        for name, weights, stacked in (("gate/up", gate_up, self.gate_up), ("down", down, self.down)):
            if len(weights) != self.num_experts:
                raise ValueError(f"{len(weights)} quantized {name} weights for {self.num_experts} experts")
            if any(w.shape != tuple(stacked.shape[1:]) for w in weights):
                raise ValueError(f"a quantized {name} weight's shape differs from {tuple(stacked.shape[1:])}")
            if len({w.packing for w in weights}) != 1:
                raise ValueError(f"the experts' {name} weights are quantized in different packings")
        self.gate_up = nn.Parameter(torch.stack([pack_quantized(w) for w in gate_up]), requires_grad=False)
        self.down = nn.Parameter(torch.stack([pack_quantized(w) for w in down]), requires_grad=False)
        self.quantized = (QUANT_PACKINGS[gate_up[0].packing], QUANT_PACKINGS[down[0].packing])
        self.packing = f"{gate_up[0].packing}+{down[0].packing}"
        # NOTE: a: bits, b: with minimums (+ 2 x the rows from which AMX tiles run: never, yet)
        self.products = tuple(value for bits, has_min in self.quantized
                              for value in (linear_kernels.QUANTIZED_PRODUCT, bits, int(has_min)))

    def pack(self, packing: str, batch_invariant: bool = False) -> None:
        """Packs every expert for Pagoda's bfloat16 kernel where ``packing`` is one of its layouts
        ("amx" measures where the tiles take over, as Linear.pack does); other packings keep the
        experts as loaded. The router is a Linear, packed with the model's others."""
        if packing not in BLOCKED_LAYOUT or self.packing is not None:
            return
        with torch.no_grad():
            gate_up = torch.stack([linear_kernels.pack_silu_mul_weight(w) for w in self.gate_up])
            down = torch.stack([linear_kernels.pack_linear_weight(w) for w in self.down])
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.packing = packing
        self.tile_rows = (tile_rows(gate_up[0], 2 * self.intermediate_size, packing, batch_invariant,
                                    fused_silu_mul=True),
                          tile_rows(down[0], self.gate.in_features, packing, batch_invariant))
        self.products = (linear_kernels.BLOCKED_PRODUCT, self.tile_rows[0], 0,
                         linear_kernels.BLOCKED_PRODUCT, self.tile_rows[1], 0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and routing weights ([tokens, k] each): a softmax over the router's
        logits in float32, its top k (the lower id first among equal ones, as the C kernel's
        moe_route takes them), renormalized where the family asks."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.sort(dim=-1, descending=True, stable=True)
        weights, experts = weights[:, :self.top_k], experts[:, :self.top_k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.products is not None and x.dtype == torch.bfloat16:
            return torch.ops.pagoda.moe_experts_native(x, self.gate(x), self.gate_up, self.down, self.top_k,
                                                       self.norm_topk_prob, self.intermediate_size, *self.products)
        experts, weights = self.route(x)
        if self.quantized is not None:  # float32 activations
            (gate_up_bits, gate_up_min), (down_bits, down_min) = self.quantized
            return torch.ops.pagoda.moe_experts_quantized(x, experts, weights, self.gate_up, self.down,
                                                          self.intermediate_size, gate_up_bits, gate_up_min,
                                                          down_bits, down_min)
        return torch.ops.pagoda.moe_experts(x, experts, weights, self.gate_up, self.down)

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """Copies one expert's ``gate_proj``, ``up_proj`` or ``down_proj`` weight (this rank's
        share) into the stacked tensors (before pack())."""
        size = self.intermediate_size
        if part == "down_proj":
            target = self.down[expert]
        else:
            target = self.gate_up[expert, :size] if part == "gate_proj" else self.gate_up[expert, size:]
        if target.shape != tensor.shape:
            raise ValueError(f"expert {expert}'s {part} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)
