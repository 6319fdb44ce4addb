"""Whole steps in one C call, for models whose linear layers run Pagoda's kernels.

Run as compiled regions between the attention calls, a step pays glue around every product
(the regions' guards and wrappers, op dispatch from Python, OpenMP's second thread spinning
while the first runs that Python). In a decode step the products are small and the glue costs
as much or more: a Q8_0 decode step of the default model took about 15.7 ms, of which the
products about 4.6. In a 2048-token prefill step it was about a tenth of the step (Intel Xeon
with AMX, 2026-12-04). :class:`OneCallForward` runs any step, decodes, prefill chunks or both,
as native/csrc/one_call_forward.c: the same operations in the same order, the
products, the KV write and the attention by the same kernels as the backend's plan for the
step (prefill chunks on the attention tiles, a cascade's shared part), the element-wise steps
rounded once from float32 as the compiled code rounds them (tests/test_one_call_forward.py:
bit for bit the eager path's so rounded). The compiled regions are not called.

It runs where the model is a single rank in bfloat16 on the CPU, every linear layer of its
decoder runs one of Pagoda's kernels (quantized weights: GGUF files' own types,
``--quantization int8``; bfloat16 weights packed "blocked" or "amx", see
engine/models/linear.py; not oneDNN's), and the attention backend is ``cpu_paged`` over a
bfloat16 cache (with batch invariance, as the backend plans: neither attention tiles nor a
cascade). A mixture of experts' layers take it too (engine/models/moe.py: the call runs the
router's product, then the function the layer's op calls), but not beside LoRA slots. A step
whose sequences share a prefix that the backend attends to as a cascade runs layer by layer
where the backend has no tiles for the shared part (head sizes other than 64 and 128). ``PAGODA_ONE_CALL_FORWARD=0`` turns it off (for A/B measurements).
"""

from __future__ import annotations

import ctypes

import torch

from pagoda.environment import read_flag
from pagoda.attention_backends import cpu_kernels
from pagoda.native import library as kernel_library
from pagoda.native import linear as linear_kernels
from pagoda.attention_backends.base import AttentionMetadata
from pagoda.engine.models.linear import BLOCKED_LAYOUT
from pagoda.engine.models.moe import SparseMoE
from pagoda.engine.models.quantized import QUANT_PACKINGS

ENV = "PAGODA_ONE_CALL_FORWARD"


def architecture_reason(config) -> str | None:
    """The part of a family's layers (ModelConfig) that the one call does not have, or None: such
    a model runs its steps layer by layer, on the same matrix and attention kernels."""
    if config.norm_unit_offset or config.sandwich_norms or config.hidden_act != "silu":
        return "Gemma's norms and GELU"
    if config.sliding_layers is not None or config.attn_logit_softcapping or config.final_logit_softcapping:
        return "sliding-window layers beside global ones, or soft-capping"
    if config.embedding_multiplier is not None or config.query_pre_attn_scalar is not None:
        return "scaled embeddings or attention scale"
    if config.rotary_dim != config.head_dim:
        return "RoPE over part of each head"
    return None


def unsupported_reason(model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Why ``model`` (a DecoderForCausalLM) cannot take the one-call path over ``kv_caches``, or None."""
    if not read_flag(ENV):
        return f"{ENV}=0"
    if model.tp.is_parallel:
        return "tensor parallelism"
    embed, rotary = model.embed_tokens.weight, model.rotary
    if embed.dtype != torch.bfloat16 or embed.device.type != "cpu" or not embed.is_contiguous():
        return "not bfloat16 on the CPU"
    if model.norm.weight.dtype != torch.bfloat16:
        return "the final norm's weight is not bfloat16"
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.shape[-1] != model.config.head_dim
           for t in (rotary.cos, rotary.sin)):
        return "RoPE's tables are not float32 [positions, head_dim]"
    if not kernel_library.available():
        return "no CPU kernels"
    if model.lora_context is not None and model.layers[0].self_attn.qkv_proj.lora.packed_a is None:
        return "LoRA slots without Pagoda's blocked bfloat16 kernel"
    backend = model.layers[0].self_attn.backend
    if getattr(backend, "name", None) != "cpu_paged":
        return "not the cpu_paged attention backend"
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        if isinstance(mlp, SparseMoE):
            if mlp.products is None:
                return "experts that do not run Pagoda's kernels"
            if model.lora_context is not None:
                return "LoRA slots beside a mixture of experts"
            products = (attention.qkv_proj, attention.o_proj, mlp.gate)
        else:
            products = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(p.packing not in QUANT_PACKINGS and p.packing not in BLOCKED_LAYOUT for p in products):
            return "a linear layer does not run Pagoda's kernels"
        if any(p.packing in QUANT_PACKINGS for p in products) and not linear_kernels.quant_linear_vector():
            return "no vector quantized kernel"
        if any(p.bias is not None for p in products[1:]):
            return "a bias beside q/k/v's"
        qkv = attention.qkv_proj
        if qkv.bias is not None and (qkv.bias.dtype != (torch.float32 if qkv.packing in QUANT_PACKINGS
                                                         else torch.bfloat16) or not qkv.bias.is_contiguous()):
            return "q/k/v's bias is not in the kernel's dtype"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if attention.q_norm is not None:
            norms += (attention.q_norm, attention.k_norm)
        if any(n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() for n in norms):
            return "a norm's weight is not bfloat16"
    if any(k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or not (k.is_contiguous() and v.is_contiguous())
           for k, v in kv_caches):
        return "the KV cache is not bfloat16"
    return None


class OneCallForward:
    """The one-call forward of one model over one set of KV caches (see the module's doc)."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        def product(linear) -> list[int]:
            if linear.packing in BLOCKED_LAYOUT:
                return [linear.weight.data_ptr(), 1, linear.amx_min_rows, 0]
            bits, has_min = QUANT_PACKINGS[linear.packing]
            return [linear.weight.data_ptr(), 0, bits, int(has_min) + 2 * linear.amx_min_rows]

        # The C side's struct moe_layer of each mixture-of-experts layer, one int64 per field (held:
        # the layers' rows point to them).
        self.moe_layers = []
        rows = []
        for layer, (key_cache, value_cache) in zip(model.layers, kv_caches, strict=True):
            attention, mlp = layer.self_attn, layer.mlp
            bias = attention.qkv_proj.bias
            qk_norms = [0, 0] if attention.q_norm is None else [attention.q_norm.weight.data_ptr(),
                                                                 attention.k_norm.weight.data_ptr()]
            if isinstance(mlp, SparseMoE):
                self.moe_layers.append(torch.tensor(linear_kernels.moe_layer_struct(
                    mlp.gate_up, mlp.products[:3], mlp.down, mlp.products[3:], mlp.intermediate_size, mlp.top_k,
                    mlp.norm_topk_prob, product(mlp.gate)), dtype=torch.int64))
                feed_forward = [0] * 8 + [self.moe_layers[-1].data_ptr()]
            else:
                feed_forward = [*product(mlp.gate_up_proj), *product(mlp.down_proj), 0]
            rows.append([layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                         *product(attention.qkv_proj), *product(attention.o_proj), *feed_forward[:8],
                         0 if bias is None else bias.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                         *qk_norms, feed_forward[8]])
        # NOTE: the C side's struct forward_layer, one int64 per field.
        self.layers = torch.tensor(rows, dtype=torch.int64)
        # With LoRA slots (engine/models/lora.py), the C side's struct lora_layer likewise.
        self.loras = None
        if model.lora_context is not None:
            def slots(linear) -> list[int]:
                lora = linear.lora
                return [lora.packed_a.data_ptr(), lora.packed_b.data_ptr(), lora.packed_a[0].numel(),
                        lora.packed_b[0].numel(), lora.width, len(lora.parts) * lora.max_rank, lora.tile_rows]

            self.loras = torch.tensor([[*slots(layer.self_attn.qkv_proj), *slots(layer.self_attn.o_proj),
                                        *slots(layer.mlp.gate_up_proj), *slots(layer.mlp.down_proj)]
                                       for layer in model.layers], dtype=torch.int64)
        self.kv_caches = kv_caches
        self.block_size = kv_caches[0][0].shape[-1]
        first = model.layers[0]
        attention = first.self_attn
        config = model.config
        self.fn = kernel_library.load().one_call_forward
        # Arguments after the step's own: everything fixed for the model.
        self.fixed = (ctypes.c_float(config.rms_norm_eps), ctypes.c_float(attention.backend.scale))
        self.model = model
        # Prefill chunks and a cascade's shared part run on the backend's tiles, as the backend runs them.
        self.tiles = attention.backend.tiles
        self.tiles_kind = 0 if self.tiles is None else cpu_kernels.tiles_kind(self.tiles)  # the C call's `tiles`
        # Every layer's window (architecture_reason leaves the one call models whose layers all
        # have the same one, or none).
        self.window = attention.window
        # NOTE: the dense layers' intermediate width, the config's in every one of them (0: every
        # layer a mixture of experts)
        dense = next((layer.mlp.intermediate_size for layer in model.layers if not isinstance(layer.mlp, SparseMoE)),
                     0)
        self.sizes = (config.hidden_size, attention.num_heads, attention.num_kv_heads, attention.head_dim,
                      dense, self.block_size, model.embed_tokens.num_embeddings,
                      model.rotary.cos.shape[0])

    def applies(self, metadata: AttentionMetadata) -> bool:
        """Whether the call takes the step: any step, but one whose sequences share a prefix that
        the backend would attend to as a cascade other than on its tiles."""
        return getattr(metadata.backend_data, "shared", None) is None or self.tiles is not None

    def takes_every_step(self) -> bool:
        """Whether no step is left to the compiled regions (see applies)."""
        return self.tiles is not None

    def _window(self, metadata: AttentionMetadata) -> int:
        """The window the step's rows attend within (0: none, or no row is past it)."""
        return self.window if self.window is not None and metadata.max_seq_len > self.window else 0

    def _attention(self, metadata: AttentionMetadata) -> tuple[int, ...]:
        """The C call's attention plan, as the backend made it for the step: the cascade's
        groups (their blocks one after the other, their count, each one's (blocks, members)
        pair, their rows' own context lengths, their members one after the other and the masks
        of the others; none: zeros) and the kind of tiles (for the shared parts and the prefill
        chunks); the number of sequences; the mask of the sequences whose chunks go to the
        prefill tiles (beside a cascade of groups: and their members), those sequences and their
        count (none: zeros). The arrays built here are held until the next step's. Where the
        window applies, none of them: every row by the paged kernel."""
        if self._window(metadata):
            return (0, 0, 0, 0, 0, 0, self.tiles_kind, metadata.num_reqs, 0, 0, 0)
        plan = metadata.backend_data
        groups = getattr(plan, "groups", None) or []  # (cpu_paged.StepPlan's)
        cascade = (0, 0, 0, 0, 0, 0)
        if groups:
            if any(not g.blocks.dtype == g.suffix_seq_lens.dtype == torch.int32 for g in groups):
                raise ValueError("one_call_forward: a shared prefix's blocks and lengths are not int32")
            sizes = torch.tensor([(g.blocks.shape[0], 0 if g.members is None else g.members.shape[0]) for g in groups],
                                 dtype=torch.int64)
            blocks = torch.cat([g.blocks for g in groups])
            lengths = torch.cat([g.suffix_seq_lens for g in groups])
            listed = groups[0].members is not None
            members = torch.cat([g.members for g in groups]) if listed else None
            others = torch.cat([g.others for g in groups]) if listed else None
            self._held = (sizes, blocks, lengths, members, others)
            cascade = (blocks.data_ptr(), len(groups), sizes.data_ptr(), lengths.data_ptr(),
                       members.data_ptr() if listed else 0, others.data_ptr() if listed else 0)
        on_tiles = (0, 0, 0)
        requests, skip = getattr(plan, "tile_requests", None), getattr(plan, "skip", None)
        if (not groups or groups[0].members is not None) and skip is not None and self.tiles is not None:
            on_tiles = (skip.data_ptr(), 0 if requests is None else requests.data_ptr(),
                        0 if requests is None else requests.shape[0])
        return (*cascade, self.tiles_kind, metadata.num_reqs, *on_tiles)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The final-normed hidden states [rows, hidden] of the step's tokens."""
        model, rows = self.model, len(input_ids)
        out = torch.empty(rows, self.sizes[0], dtype=torch.bfloat16)
        rotary, block_tables = model.rotary, metadata.block_tables
        if not (input_ids.dtype == positions.dtype == metadata.slot_mapping.dtype == torch.int64
                and block_tables.dtype == metadata.seq_lens_tensor.dtype == metadata.query_start_loc.dtype
                == torch.int32 and block_tables.stride(1) == 1 and input_ids.is_contiguous()
                and positions.is_contiguous() and metadata.slot_mapping.is_contiguous()):
            raise ValueError("one_call_forward: the step's tensors are not int64 ids, positions and slots and "
                             "int32 block tables (rows contiguous), sequence lengths and query starts")
        segments = model.lora_context.segments if self.loras is not None else None
        lora = (0 if self.loras is None else self.loras.data_ptr(), 0 if segments is None else segments.data_ptr(),
                0 if segments is None else len(segments))
        failed = self.fn(self.layers.data_ptr(), len(self.layers), rows, model.embed_tokens.weight.data_ptr(),
                         input_ids.data_ptr(), positions.data_ptr(), metadata.slot_mapping.data_ptr(),
                         block_tables.data_ptr(), block_tables.stride(0), metadata.seq_lens_tensor.data_ptr(),
                         metadata.query_start_loc.data_ptr(), rotary.cos.data_ptr(), rotary.sin.data_ptr(),
                         model.norm.weight.data_ptr(), *self.sizes, *self.fixed, self._window(metadata),
                         *self._attention(metadata),
                         *lora, out.data_ptr())
        if failed == -2:
            vocab, max_positions = self.sizes[6], self.sizes[7]
            tokens = input_ids[(input_ids < 0) | (input_ids >= vocab)].tolist()
            places = positions[(positions < 0) | (positions >= max_positions)].tolist()
            raise IndexError(f"tokens {tokens} or positions {places} out of range "
                             f"(vocabulary {vocab}, positions {max_positions})")
        if failed:
            raise MemoryError("one_call_forward: out of memory for its activations")
        return out
