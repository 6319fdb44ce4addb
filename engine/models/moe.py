"""A mixture-of-experts MLP: a router picks each token's top k experts, each expert is a SwiGLU
MLP, and a token's output is the routing-weighted sum of its experts' outputs.

The step's tokens are grouped by expert (one sort of the token-expert pairs), and each expert
that got tokens multiplies its rows at once: the loop runs over experts, never over tokens or
requests, and an expert that got no token this step costs nothing. The experts' weights are
stacked ([experts, 2 x intermediate, hidden] for gate and up, [experts, hidden, intermediate]
for down); under tensor parallelism each rank holds every expert's share of the intermediate
width, so the layer's output is a partial sum that the decoder layer all-reduces as it does a
dense MLP's.

The grouped product is one opaque op, ``pagoda::moe_experts``, to torch.compile: its loop
depends on the routing (data), which would break the compiled region's graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.engine.models.linear import Linear

_library = torch.library.Library("pagoda", "FRAGMENT")
_library.define("moe_experts(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, Tensor down) -> Tensor")


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
    out = torch.zeros_like(x)
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)  # NOTE: stable, so each expert's tokens stay in order
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()  # one read-back a layer
    tokens = order // k
    pair_weights = weights.reshape(-1)[order].unsqueeze(1)
    intermediate = down.shape[2]
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = tokens[start:start + count]
        gate, up = F.linear(x.index_select(0, rows), gate_up[expert]).split(intermediate, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, rows, y * pair_weights[start:start + count])
        start += count
    return out


_library.impl("moe_experts", moe_experts, "CompositeExplicitAutograd")


@torch.library.register_fake("pagoda::moe_experts")
def _(x, experts, weights, gate_up, down):
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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and routing weights ([tokens, k] each): a softmax over the router's
        logits in float32, its top k, renormalized where the family asks."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        return torch.ops.pagoda.moe_experts(x, experts, weights, self.gate_up, self.down)

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """Copies one expert's ``gate_proj``, ``up_proj`` or ``down_proj`` weight (this rank's
        share) into the stacked tensors."""
        size = self.intermediate_size
        if part == "down_proj":
            target = self.down[expert]
        else:
            target = self.gate_up[expert, :size] if part == "gate_proj" else self.gate_up[expert, size:]
        if target.shape != tensor.shape:
            raise ValueError(f"expert {expert}'s {part} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)
