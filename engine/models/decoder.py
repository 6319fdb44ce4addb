"""The decoder every model family is built from, over a flattened token batch.

A family (engine/families) says which parts its layers take: q/k/v with or without bias, an
RMS norm per query and key head (Qwen3), a gated MLP or a mixture of experts
(engine/models/moe.py: Mixtral, Qwen3-MoE), RoPE and its scaling, a tied or untied head; and how
its checkpoint names its tensors. Nothing here branches on a family's name.

Every step runs all scheduled tokens of every request as one [num_tokens, hidden]
batch: no padding, no loop over requests. Attention goes through the backend, which
reads and writes the paged KV cache.

The forward pass is cut at the attention calls into three kinds of regions: before the
first attention (embedding, norm, q/k/v, RoPE), between two attentions (o_proj,
residual, norm, MLP, residual, the next layer's norm, q/k/v and RoPE) and after the
last one. The regions are plain functions of the layers they touch, so with
``compile=True`` each is compiled once by torch.compile (inductor, dynamic shapes) and
reused by every layer, which fuses the element-wise work (norms, RoPE, residual adds,
and SiLU-mul unless the linear kernel's epilogue does it) between the matrix products;
attention stays outside, in Python, with whatever the backend needs. RoPE's cos/sin are
gathered once per step, not per layer.

On the CPU in bfloat16, the linear layers' weights (the LM head's too) are repacked once
after loading (``pack_weights``) for a faster kernel: see engine/models/linear.py.

With tensor parallelism each rank builds the model with its share of heads, of the MLP
and of the vocabulary (engine/worker/distributed.py); ``load_weights`` cuts each checkpoint tensor
down to the rank's share, and the row-parallel outputs and the embedding are all-reduced.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention_backends.base import AttentionBackend, AttentionMetadata
from pagoda.engine.families import FAMILIES
from pagoda.engine.tensor_parallel import even_split, head_share
from pagoda.engine.worker.distributed import TensorParallelGroup
from pagoda.engine.model_config import ModelConfig
from pagoda.engine.models import one_call_forward
from pagoda.engine.models.linear import (BLOCKED_LAYOUT, QUANT_PACKINGS, GateUpLinear, Linear, LinearMethod,
                                          method_for, pack_weight, quant_tile_rows, tile_rows)
from pagoda.engine.models.moe import RouterLinear, SparseMoE
from pagoda.engine.models.precompiled import PrecompiledRegion
from pagoda.engine.models.quantized import GroupQuantized
from pagoda.engine.models.quantized import pack as pack_quantized
from pagoda.engine.models.rope import compute_inv_freq

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Llama's RMS norm, or with ``unit_offset`` Gemma's (times 1 + weight, in float32)."""

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        # NOTE: normalised in float32 and cast back before the weight, as transformers does.
        return self.weight * x32.to(x.dtype)


def rms_norm(config: ModelConfig, size: int | None = None) -> RMSNorm:
    """An RMS norm of the family's kind, over ``size`` (default: the hidden size)."""
    return RMSNorm(size or config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (rotate-half layout); ``local``:
    the sliding layers' (their own base, no scaling), where the family gives them one."""

    def __init__(self, config: ModelConfig, max_positions: int, local: bool = False) -> None:
        super().__init__()
        if local:
            config = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
        if torch.get_default_device().type == "meta":
            # NOTE: placeholders, like every tensor of a model built on the meta device: the
            # ops would only be traced there, and tracing them imports torch._dynamo (2 s).
            cos = sin = torch.empty(max_positions, config.rotary_dim)
        else:
            inv_freq, attention_scaling = compute_inv_freq(config, max_positions)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * attention_scaling, emb.sin() * attention_scaling
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] cos and sin of the step's positions, gathered once for every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (transformers' form; cos and sin repeat their halves).

    NOTE: with the halves on a dimension of their own, stacked rather than concatenated along
    the last one, inductor's code for it is faster (q and k of 2048 tokens, 29 layers, compiled:
    8.5 -> 5.5 ms) and gives the same bits.
    """
    half = x.shape[-1] // 2
    x1, x2 = x.unflatten(-1, (2, half)).unbind(-2)
    cos, sin = cos[..., :half], sin[..., :half]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-2).flatten(-2)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallelGroup,
                 index: int = 0) -> None:
        super().__init__()
        share = head_share(config.num_attention_heads, config.num_key_value_heads, tp.rank, tp.world_size)
        self.num_heads = share.num_heads
        self.num_kv_heads = share.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # NOTE: q, k and v are one fused matrix product; weights are concatenated at load.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        # Qwen3, Gemma 3: an RMS norm over each query and key head, before RoPE.
        self.q_norm = rms_norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = rms_norm(config, self.head_dim) if config.qk_norm else None
        self.backend = backend
        # NOTE: where every layer has a window, only on a backend that runs windows (kv_sizing
        # then serves past the window); on others no request is longer than the window and
        # attention is plain causal.
        self.window = (config.layer_window(index)
                       if config.sliding_layers is not None or backend.supports_window_and_softcap else None)
        self.softcap = config.attn_logit_softcapping
        self.local_rope = self.window is not None and config.local_rope_theta is not None
        self.rotary_dim = config.rotary_dim

    def attend(self, q, k, v, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        """The backend's attention, within this layer's window and soft cap where it has them."""
        if self.window is None and self.softcap is None:
            return self.backend.forward(q, k, v, kv_cache, metadata)
        if self.window is not None and metadata.sliding is not None:
            metadata = metadata.sliding  # the sliding layers' own blocks
        return self.backend.forward(q, k, v, kv_cache, metadata, window=self.window, softcap=self.softcap)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rope(q, cos, sin), self.rope(k, cos, sin), v.view(-1, self.num_kv_heads, self.head_dim)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE over the head's first ``rotary_dim`` dimensions (all of them but in Phi-4-mini's
        kind); the others pass through."""
        if self.rotary_dim == self.head_dim:
            return apply_rope(x, cos, sin)
        rotated, passed = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat((apply_rope(rotated, cos, sin), passed), dim=-1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        start, end = even_split(config.intermediate_size, tp.rank, tp.world_size)
        self.intermediate_size = end - start
        # NOTE: gate_proj and up_proj are one fused product, SiLU(gate) * up included (GELU's
        # is applied after the product).
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        product = Linear if self.gelu else GateUpLinear
        self.gate_up_proj = product(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(self.gate_up_proj(x))


def sparse_moe(config: ModelConfig, tp: TensorParallelGroup) -> SparseMoE:
    """A mixture-of-experts MLP with this rank's share of every expert."""
    start, end = even_split(config.moe_intermediate_size, tp.rank, tp.world_size)
    return SparseMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok, end - start,
                     config.norm_topk_prob)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallelGroup,
                 index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(config)
        self.self_attn = Attention(config, backend, tp, index)
        self.post_attention_layernorm = rms_norm(config)  # the MLP's input norm
        self.mlp = sparse_moe(config, tp) if config.layer_is_moe(index) else MLP(config, tp)
        # Gemma: the attention's and the MLP's outputs normed before their residual adds.
        self.attn_out_norm = rms_norm(config) if config.sandwich_norms else None
        self.mlp_out_norm = rms_norm(config) if config.sandwich_norms else None
        self.tp = tp

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer after attention: o_proj, residual, norm, MLP, residual (row-parallel
        outputs summed over the tensor-parallel ranks; sandwich norms where the family has them)."""
        out = self.tp.all_reduce(self.self_attn.o_proj(attn.reshape(attn.shape[0], -1)))
        hidden = residual + (out if self.attn_out_norm is None else self.attn_out_norm(out))
        out = self.tp.all_reduce(self.mlp(self.post_attention_layernorm(hidden)))
        return hidden + (out if self.mlp_out_norm is None else self.mlp_out_norm(out))


# -- the regions between attention calls (compiled once each, shared by every layer) --------


def before_first_attention(embed: VocabParallelEmbedding, layer: DecoderLayer, input_ids, cos, sin):
    hidden = embed(input_ids)
    if embed.multiplier is not None:  # Gemma: sqrt(hidden), in the embeddings' dtype
        hidden = hidden * torch.tensor(embed.multiplier, dtype=hidden.dtype)
    q, k, v = layer.self_attn.qkv(layer.input_layernorm(hidden), cos, sin)
    return q, k, v, hidden


def between_attentions(layer: DecoderLayer, next_layer: DecoderLayer, attn, residual, cos, sin):
    hidden = layer.finish(attn, residual)
    q, k, v = next_layer.self_attn.qkv(next_layer.input_layernorm(hidden), cos, sin)
    return q, k, v, hidden


def after_last_attention(layer: DecoderLayer, norm: RMSNorm, attn, residual):
    return norm(layer.finish(attn, residual))


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows [vocab_start, vocab_end) of this rank; other ids look up zeros, and
    the ranks' results are summed (every id is on exactly one rank)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup,
                 multiplier: float | None = None) -> None:
        self.vocab_start, self.vocab_end = even_split(vocab_size, tp.rank, tp.world_size)
        # NOTE: an uninitialised weight (the checkpoint's replaces it): nn.Embedding's own
        # init, normal_, on the meta device imports torch._dynamo, 2 s of every eager start.
        rows = self.vocab_end - self.vocab_start
        super().__init__(rows, hidden_size, _weight=torch.empty(rows, hidden_size))
        self.tp = tp
        self.multiplier = multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return super().forward(input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        hidden = super().forward((input_ids - self.vocab_start) * mine) * mine.unsqueeze(-1)
        return self.tp.all_reduce(hidden)


#: Most candidates one row's tie is broken among (a bound on the work; real ties are 2-3).
MAX_TIE_CANDIDATES = 64


def break_bfloat16_ties(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                        rows: torch.Tensor) -> torch.Tensor:
    """Float32 logits in which greedy rows' top candidates hold float32 sums.

    A bfloat16 logit keeps 8 bits of mantissa: at |logit| 2-4 its step is 1/64, and two
    candidates whose float32 sums differ by less come out equal or swapped (the default
    model's first answer token to "What is the capital of France?" tied at -1.878 on an AMX
    machine and the answer went astray). For each greedy row, the tokens within two steps of
    its maximum are summed again in float32 from the same bfloat16 hidden state and weights,
    so that argmax picks the float32 winner. Every row is returned in float32 (the sampler
    computes in float32 anyway, and its argmax is faster there: with the two passes here, a
    64-row greedy step's logits took 2.3 ms where the bfloat16 argmax alone took 1.3).

    Args:
        logits: [rows, vocab] bfloat16.
        hidden: [rows, hidden] the LM head's input.
        weight: [vocab, hidden] the LM head's weight, unpacked.
        rows: Indices of the greedy rows, ascending.

    Returns:
        [rows, vocab] float32.
    """
    logits = logits.float()
    every_row = len(rows) == len(logits)  # then rows is 0, 1, 2, ...
    sub = logits if every_row else logits.index_select(0, rows)
    # NOTE: the runner-up from a second pass with the maximum masked: two passes over the
    # rows (about 1 ms for 64 rows of 49,152 here) where counting the near ones took three.
    top, top_ids = sub.max(dim=-1, keepdim=True)
    sub.scatter_(1, top_ids, float("-inf"))
    second = sub.amax(dim=-1, keepdim=True)
    sub.scatter_(1, top_ids, top)
    step = torch.exp2(torch.floor(torch.log2(top.abs().clamp_min(1e-30))) - 7)
    threshold = top - 2 * step
    for i in (second >= threshold).squeeze(1).nonzero().squeeze(1).tolist():
        row = i if every_row else int(rows[i])
        candidates = (sub[i] >= threshold[i]).nonzero().squeeze(1)[:MAX_TIE_CANDIDATES]
        logits[row, candidates] = weight.index_select(0, candidates).float() @ hidden[row].float()
    return logits


def _checkpoint_names(module_name: str) -> tuple[str, ...]:
    """A linear layer's checkpoint weights ("layers.0.self_attn.q_proj.weight", ... for the
    fused "layers.0.self_attn.qkv_proj")."""
    prefix, _, last = module_name.rpartition(".")
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(last, (last,))
    return tuple(f"{prefix}.{part}.weight" if prefix else f"{part}.weight" for part in parts)


class DecoderForCausalLM(nn.Module):
    """The model (of any family in engine/families). ``forward`` returns hidden states; ``compute_logits`` runs the LM head
    only on the rows that sample.

    Args:
        config: The model configuration.
        backend: The attention backend (built for this rank's heads).
        max_positions: Length of the RoPE tables.
        tp: This rank's tensor-parallel group (None: the whole model on one rank).
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallelGroup()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp,
                                                   config.embedding_multiplier)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, tp, i) for i in range(config.num_hidden_layers))
        self.norm = rms_norm(config)
        self.rotary = RotaryEmbedding(config, max_positions)
        # The sliding layers' RoPE, where its base differs (Gemma 3).
        self.local_rotary = (RotaryEmbedding(config, max_positions, local=True)
                             if config.local_rope_theta is not None and config.sliding_layers is not None else None)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            start, end = self.embed_tokens.vocab_start, self.embed_tokens.vocab_end
            self.lm_head = Linear(config.hidden_size, end - start, bias=False)
        self._vocab_shares = [b - a for a, b in (even_split(config.vocab_size, r, tp.world_size)
                                                 for r in range(tp.world_size))]
        self.use_eager_regions()
        # A tied LM head's packed or quantized copy of the embedding table, and its method.
        self._packed_lm_head: tuple[torch.Tensor, LinearMethod] | None = None
        # An untied LM head's weight as loaded, once the head is packed (break_bfloat16_ties).
        self._unpacked_lm_head: torch.Tensor | None = None
        # The one-call path of whole steps over the KV caches it was built for
        # (prepare_one_call_forward; None: not for this model).
        self._one_call: one_call_forward.OneCallForward | None = None
        # The part of this family that the one call lacks (prepare_one_call_forward), if any.
        self.layer_by_layer_reason: str | None = None
        # The LoRA slots' step state (engine/models/lora.py), with --enable-lora.
        self.lora_context = None

    def compile_regions(self, directory: Path | None = None) -> None:
        """Compiles the three regions with torch.compile (inductor, dynamic shapes), ahead of
        time per variant of their inputs, kept in ``directory`` for later starts (see
        engine/models/precompiled.py; None: not kept)."""
        # NOTE: floats specialized, so RMSNorm's eps is a constant in the code rather than a
        # 0-dim tensor input built on every call; and no size asserts on the inputs (the
        # guards have checked them). With both, one token's forward: 13.6-15.2 -> 13.0-13.2 ms
        # (10th percentile), 15.2-17.8 -> 13.8-14.4 ms (median).
        torch._dynamo.config.specialize_float = True
        self._regions = tuple(PrecompiledRegion(fn, directory, {"size_asserts": False})
                              for fn in (before_first_attention, between_attentions, after_last_attention))

    def use_eager_regions(self) -> None:
        """Back to the regions as plain functions (after a compile that failed)."""
        self._regions = (before_first_attention, between_attentions, after_last_attention)

    def describe_code(self) -> tuple:
        """What the compiled regions' code depends on beyond the sources and the CPU: the
        configuration, the dtype and each linear layer's packing (see precompiled.cache_key)."""
        return (self.config, self.embed_tokens.weight.dtype,
                sorted({(type(m).__name__, m.packing, getattr(m, "amx_min_rows", None), getattr(m, "tile_rows", None),
                         getattr(m, "lora", None) is not None)
                        for m in self.modules() if isinstance(m, (Linear, SparseMoE))}, key=repr))

    def quantize_weights(self, pick: Callable[[tuple[str, ...], torch.Tensor], GroupQuantized | None]) -> list[str]:
        """Quantizes the linear layers and the LM head that ``pick`` gives a weight for.

        ``pick(names, weight)`` gets the checkpoint names a layer's weight was loaded from
        ("layers.0.self_attn.q_proj.weight", ... for the fused q/k/v; "embed_tokens.weight"
        for a tied LM head) and the float weight as loaded, and returns the quantized
        weight, or None to keep the layer in floats; a mixture-of-experts layer's experts, each
        expert's "layers.N.mlp.experts.E.gate_proj.weight" and the others, are quantized where
        it gives them all (_quantize_experts). Returns the packings used, one per quantized layer
        ("q4m+q8 experts" for a layer's experts).

        Raises:
            ValueError: Under tensor parallelism (not supported with quantized weights).
        """
        if self.tp.is_parallel:
            raise ValueError("quantized weights do not run under tensor parallelism yet; pass --quantization none")
        self._one_call = None  # it holds the weights' addresses
        packings = []
        for name, module in self.named_modules():
            if isinstance(module, SparseMoE):
                packings.extend(self._quantize_experts(name, module, pick))
            if not isinstance(module, Linear) or isinstance(module, RouterLinear):
                continue
            names = _checkpoint_names(name)
            weight = pick(names, module.weight)
            if weight is not None:
                module.quantize(weight)
                packings.append(weight.packing)
        if self.lm_head is None:
            weight = pick(("embed_tokens.weight",), self.embed_tokens.weight)
            if weight is not None:
                self._packed_lm_head = (pack_quantized(weight), method_for(weight.packing))
                packings.append(weight.packing)
        return packings

    def quantized_names(self) -> set[str]:
        """The checkpoint names (as quantize_weights gives them to ``pick``) of the weights that
        quantize_weights replaced: a checkpoint's floats of these are not needed."""
        names: set[str] = set()
        for name, module in self.named_modules():
            if isinstance(module, SparseMoE) and module.quantized is not None:
                names.update(f"{name}.experts.{e}.{part}.weight" for e in range(module.num_experts)
                             for part in ("gate_proj", "up_proj", "down_proj"))
            elif isinstance(module, Linear) and module.packing in QUANT_PACKINGS:
                names.update(_checkpoint_names(name))
        return names

    @staticmethod
    def _quantize_experts(name: str, moe: SparseMoE, pick) -> list[str]:
        """Quantizes a mixture-of-experts layer's experts where ``pick`` gives a weight for every
        expert's gate/up and down, in one packing each (see quantize_weights); returns
        ["<gate/up's packing>+<down's> experts"], or [] where they stay in floats."""
        gate_up, down = [], []
        for e in range(moe.num_experts):
            prefix = f"{name}.experts.{e}"
            gate_up.append(pick((f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"), moe.gate_up[e]))
            down.append(pick((f"{prefix}.down_proj.weight",), moe.down[e]))
        if (any(w is None for w in gate_up + down) or len({w.packing for w in gate_up}) > 1
                or len({w.packing for w in down}) > 1):
            return []  # NOTE: kept in floats: the experts are stacked in one tensor, of one packing
        moe.quantize(gate_up, down)
        return [f"{moe.packing} experts"]

    def pack_weights(self, packing: str, batch_invariant: bool = False) -> None:
        """Repacks every linear weight (and a tied LM head) for ``packing``, but those
        already quantized (quantize_weights); see engine/models/linear.py (Linear.pack).
        With "amx", the quantized ones without bias (a tied LM head too) get the row count from
        which their products run on the tiles (Linear.tile_quantized)."""
        self._one_call = None  # it holds the weights' addresses
        if (self.lm_head is not None and self.lm_head.packing is None and not self.tp.is_parallel
                and packing not in BLOCKED_LAYOUT):
            # NOTE: kept for break_bfloat16_ties (Pagoda's kernel gives float32 logits instead).
            self._unpacked_lm_head = self.lm_head.weight
        for module in self.modules():
            if isinstance(module, SparseMoE) or (isinstance(module, Linear) and module.packing is None):
                module.pack(packing, batch_invariant)
            elif isinstance(module, Linear) and packing == "amx" and not batch_invariant:
                module.tile_quantized()
        if (self._packed_lm_head is not None and self._packed_lm_head[1].packing in QUANT_PACKINGS
                and packing == "amx" and not batch_invariant):
            weight, quantized = self._packed_lm_head  # a tied head quantize_weights packed
            self._packed_lm_head = (weight, method_for(quantized.packing, quant_tile_rows(
                weight, quantized.packing, self.embed_tokens.num_embeddings, self.embed_tokens.embedding_dim)))
        if self.lm_head is None and self._packed_lm_head is None:
            weight = pack_weight(self.embed_tokens.weight, packing)
            rows = tile_rows(weight, self.embed_tokens.num_embeddings, packing, batch_invariant)
            self._packed_lm_head = (weight, method_for(packing, rows))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        one_call = self._one_call
        if one_call is not None and kv_caches is one_call.kv_caches and one_call.applies(metadata):
            return one_call(input_ids, positions, metadata)
        lora = self.lora_context
        if lora is not None and lora.groups:
            # NOTE: a step with adapter rows that the one call does not take runs the regions
            # eagerly: the compiled ones are the base model's.
            first, between, last = before_first_attention, between_attentions, after_last_attention
        else:
            first, between, last = self._regions
        dtype = self.embed_tokens.weight.dtype
        rope = self.rotary.cos_sin(positions, dtype)
        local = rope if self.local_rotary is None else self.local_rotary.cos_sin(positions, dtype)
        layers = self.layers
        q, k, v, residual = first(self.embed_tokens, layers[0], input_ids,
                                  *(local if layers[0].self_attn.local_rope else rope))
        for i, layer in enumerate(layers):
            attn = layer.self_attn.attend(q, k, v, kv_caches[i], metadata)
            if i + 1 < len(layers):
                following = layers[i + 1]
                q, k, v, residual = between(layer, following, attn, residual,
                                            *(local if following.self_attn.local_rope else rope))
        return last(layers[-1], self.norm, attn, residual)

    def prepare_one_call_forward(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Has steps over ``kv_caches`` run in one call where the model allows
        (engine/models/one_call_forward.py); returns whether they will. Call it again after the
        weights change (loading, packing and quantizing undo it). Where the family has a part
        the call lacks, :attr:`layer_by_layer_reason` says which."""
        self.layer_by_layer_reason = one_call_forward.architecture_reason(self.config)
        reason = self.layer_by_layer_reason or one_call_forward.unsupported_reason(self, kv_caches)
        if reason is not None:
            logger.debug("steps run layer by layer: %s", reason)
        self._one_call = None if reason is not None else one_call_forward.OneCallForward(self, kv_caches)
        return self._one_call is not None

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decoded token reads (of this rank): every parameter but the
        embedding table, of which it gathers one row (unless a tied head multiplies the table
        itself), the packed head, and of each mixture-of-experts layer top_k of its experts.
        Over the machine's memory read rate, the floor of a single stream's time per token."""
        total = sum(t.nbytes for t in self.parameters())
        if self.lm_head is not None or self._packed_lm_head is not None:
            total -= self.embed_tokens.weight.nbytes
        if self._packed_lm_head is not None:
            total += self._packed_lm_head[0].nbytes
        for module in self.modules():
            if isinstance(module, SparseMoE):
                experts = module.gate_up.nbytes + module.down.nbytes
                total -= experts - experts * module.top_k // module.num_experts
        return total

    def one_call_takes_every_step(self) -> bool:
        """Whether every step runs in one call (prepare_one_call_forward), none layer by layer."""
        return self._one_call is not None and self._one_call.takes_every_step()

    def compute_logits(self, hidden: torch.Tensor, greedy_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, vocab] logits, gathered from every tensor-parallel rank's share of the
        vocabulary: float32 sums where Pagoda's CPU kernel runs the LM head (never rounded
        to bfloat16), else in the model's dtype (the sampler upcasts where it must).

        Args:
            hidden: The final hidden states of the rows that sample.
            greedy_rows: Rows sampled greedily, if any; where the logits come out in
                bfloat16, their top candidates get float32 sums, and the logits come back
                in float32 (see break_bfloat16_ties).
        """
        if self._packed_lm_head is not None:
            weight, method = self._packed_lm_head
            logits = method.logits(hidden, weight, None, self.embed_tokens.num_embeddings)
        elif self.lm_head is not None:
            logits = self.lm_head.logits(hidden)
        else:
            logits = F.linear(hidden, self.embed_tokens.weight)
        # NOTE: not under tensor parallelism, where each rank holds a share of the vocabulary.
        if greedy_rows is not None and logits.dtype == torch.bfloat16 and not self.tp.is_parallel:
            logits = break_bfloat16_ties(logits, hidden, self._unpacked_lm_head_weight(), greedy_rows)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2; monotonic, so greedy_tokens' argmax stands
            logits = torch.tanh(logits / cap) * cap
        return self.tp.all_gather_last_dim(logits, self._vocab_shares)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's greedy token (the index compute_logits' largest logit has, the first on
        ties) without writing the logits, where the LM head runs on the quantized kernel
        (csrc/quant_linear.c, quant_linear_argmax: the LM head's output was 12.6 MB a
        64-request step, and the sampler's pass over it 1.6-2.2 ms); else None.
        """
        if self.tp.is_parallel:
            return None
        if self._packed_lm_head is not None:
            weight, method = self._packed_lm_head
            return method.greedy_tokens(hidden, weight, None, self.embed_tokens.num_embeddings)
        return None if self.lm_head is None else self.lm_head.greedy_tokens(hidden)

    def _unpacked_lm_head_weight(self) -> torch.Tensor:
        """The LM head's [vocab, hidden] weight as loaded (tied: the embedding itself)."""
        if self.lm_head is None:
            return self.embed_tokens.weight
        return self.lm_head.weight if self._unpacked_lm_head is None else self._unpacked_lm_head

    def _share_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor (the decoder's name, "model." stripped)."""
        tp = self.tp
        if not tp.is_parallel:
            return tensor
        parts = name.split(".")
        kind = parts[-2] if len(parts) >= 2 else ""
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return tensor[self.embed_tokens.vocab_start : self.embed_tokens.vocab_end]
        if kind in ("q_proj", "k_proj", "v_proj", "o_proj"):
            config = self.config
            share = head_share(config.num_attention_heads, config.num_key_value_heads, tp.rank, tp.world_size)
            dim = config.head_dim
            if kind == "q_proj":
                return tensor[share.q_start * dim : share.q_end * dim]
            if kind == "o_proj":
                return tensor[:, share.q_start * dim : share.q_end * dim]
            return tensor[share.kv_start * dim : share.kv_end * dim]
        if kind in ("gate_proj", "up_proj", "down_proj"):
            width = self.config.moe_intermediate_size if ".experts." in name else self.config.intermediate_size
            start, end = even_split(width, tp.rank, tp.world_size)
            return tensor[:, start:end] if kind == "down_proj" else tensor[start:end]
        return tensor

    def _checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The checkpoint's tensors under the decoder's names (the family's renames; fused ones
        cut into their parts), "model." stripped, rotary tables and a tied head's copy left out."""
        family = FAMILIES[self.config.architecture]
        config = self.config
        rows = {"q": config.num_attention_heads * config.head_dim, "kv": config.num_key_value_heads * config.head_dim,
                "intermediate": config.intermediate_size}
        for name, tensor in weights:
            name = family.checkpoint_name(name.removeprefix("model."))
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue  # NOTE: tied: some checkpoints store the copy anyway
            split = family.split_fused(name, rows)
            if split is None:
                yield name, tensor
                continue
            if tensor.shape[0] != sum(size for _, size in split):
                raise ValueError(f"weight {name!r} has {tensor.shape[0]} rows, expected "
                                 f"{' + '.join(str(size) for _, size in split)}")
            yield from zip((part for part, _ in split), tensor.split([size for _, size in split]))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads a checkpoint's tensors, fusing q/k/v and gate/up as they come and stacking each
        layer's experts.

        Raises:
            ValueError: A tensor is missing, unexpected or of the wrong shape.
        """
        self._one_call = None  # it holds the weights' addresses
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        # NOTE: quantize_weights may run first (a GGUF file's blocks): those weights are in.
        loaded: set[str] = set()
        for name, module in self.named_modules():
            if isinstance(module, Linear) and module.packing in QUANT_PACKINGS:
                loaded.add(f"{name}.weight")
            elif isinstance(module, SparseMoE) and module.quantized is not None:
                loaded.update((f"{name}.gate_up", f"{name}.down"))
        fused = {"q_proj": ("qkv_proj", 3), "k_proj": ("qkv_proj", 3), "v_proj": ("qkv_proj", 3),
                 "gate_proj": ("gate_up_proj", 2), "up_proj": ("gate_up_proj", 2)}
        order = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
        experts_seen: dict[str, set[tuple[int, str]]] = {}
        for name, tensor in self._checkpoint_tensors(weights):
            tensor = self._share_of(name, tensor)
            parts = name.split(".")
            if len(parts) == 7 and parts[3] == "experts" and parts[0] == "layers":  # layers.N.mlp.experts.E.part.weight
                moe = self.layers[int(parts[1])].mlp
                expert = int(parts[4])
                if not isinstance(moe, SparseMoE) or expert >= moe.num_experts or parts[6] != "weight":
                    raise ValueError(f"unexpected weight {name!r} in the checkpoint")
                moe.load_expert(expert, parts[5], tensor)
                experts_seen.setdefault(".".join(parts[:3]), set()).add((expert, parts[5]))
                continue
            if len(parts) >= 2 and parts[-2] in fused:
                target, num_parts = fused[parts[-2]]
                target_name = ".".join(parts[:-2] + [target, parts[-1]])
                group = pending.setdefault(target_name, {})
                group[parts[-2]] = tensor
                if len(group) < num_parts:
                    continue
                tensor = torch.cat([t for _, t in sorted(group.items(), key=lambda kv: order[kv[0]])], dim=0)
                del pending[target_name]
                name = target_name
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            param.copy_(tensor)
            loaded.add(name)
        for prefix, module in self.named_modules():
            if isinstance(module, SparseMoE):
                complete = len(experts_seen.get(prefix, ())) == 3 * module.num_experts
                loaded.update({f"{prefix}.gate_up", f"{prefix}.down"} if complete else ())
        missing = sorted(set(params) - loaded)
        if pending or missing:
            raise ValueError(f"weights missing from the checkpoint: {', '.join(missing + sorted(pending))}")
