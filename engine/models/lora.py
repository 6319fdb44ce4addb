"""LoRA in the worker: a slot table of adapters per layer, and each step's rows per slot.

Every adapted layer (a decoder's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and
``down_proj``) gets a :class:`LoRALayer` holding ``max_loras`` slots: for slot s,
``a[s]`` ([parts x R, in]) stacks the A of each projection fused in the layer (q, k and v;
gate and up) and ``b[s]`` ([out, parts x R]) their B (scaled) block-diagonally, zero where
an adapter has no such target or a lower rank than R = ``--max-lora-rank``; so one adapter's
delta on a fused layer is two products, ``(x @ a[s].T) @ b[s].T``.

A step's batch mixes requests of different adapters and of the base model. The base product
runs once for all rows, with whatever kernel the layer's packing uses; then, per slot used in
the step, its rows' delta is added (a slice where the slot's rows are contiguous, else a
gather and an index_add). :class:`LoRAManager` gives adapters slots, least recently used
first out, from the adapters the engine has sent (engine/lora.py checked them), and keeps at
most ``max_cpu_loras`` of those.

With tensor parallelism each rank keeps its share of every adapter: B's rows for the
column-parallel projections (q, k, v, gate, up), A's columns for the row-parallel ones
(o, down), whose partial deltas are summed with the base output's all-reduce.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from pagoda.native import linear as linear_kernels
from pagoda.native.linear import pack_linear_weight

logger = logging.getLogger(__name__)

#: The projections fused in each adapted layer of the decoder, in the order of its output.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
               "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
ROW_PARALLEL = ("o_proj", "down_proj")
#: Rows from which a packed slot's products run on AMX tiles, where they run.
LORA_TILE_ROWS = 16


class LoRAContext:
    """The step's adapter rows, shared by every adapted layer: runs of rows of one slot, as
    (slot, start, end) triples (``groups``; None in a step without adapter rows) and as an int64
    [runs, 3] tensor (``segments``, for the one-call forward)."""

    __slots__ = ("groups", "segments")

    def __init__(self) -> None:
        self.groups: list[tuple[int, int, int]] | None = None
        self.segments: torch.Tensor | None = None


class LoRALayer:
    """One layer's slots (see the module's docstring)."""

    def __init__(self, prefix: str, parts: tuple[str, ...], part_rows: list[int], in_features: int, slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device, context: LoRAContext,
                 packed: bool = False) -> None:
        self.prefix = prefix
        self.parts = parts
        self.part_rows = part_rows
        self.max_rank = max_rank
        self.context = context
        # NOTE: packed, a multiple of 32, which the AMX tiles take (the columns past the parts' are zero).
        self.width = width = -(-len(parts) * max_rank // 32) * 32 if packed else len(parts) * max_rank
        # With ``packed`` (bfloat16 on a CPU with Pagoda's blocked kernel), the slots are kept in
        # that kernel's layout only (for it and the one-call forward, native/csrc/one_call_forward.c),
        # and a and b are one slot's staging; else a and b are the slots.
        staging = 1 if packed else slots
        self.a = torch.zeros(staging, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(staging, sum(part_rows), width, dtype=dtype, device=device)
        self.packed_a = self.packed_b = None
        self.tile_rows = LORA_TILE_ROWS if packed and linear_kernels.packed_linear_amx_available() else 0
        if packed:
            self.packed_a = pack_linear_weight(self.a[0]).unsqueeze(0).repeat(slots, 1, 1, 1, 1)
            self.packed_b = pack_linear_weight(self.b[0]).unsqueeze(0).repeat(slots, 1, 1, 1, 1)

    def fill(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], share) -> None:
        """Puts an adapter's tensors for this layer into ``slot`` (zeros where it has none);
        ``share(name, tensor)`` cuts a checkpoint tensor to this rank's share."""
        packed, slot = (slot, 0) if self.packed_a is not None else (None, slot)
        self.a[slot].zero_()
        self.b[slot].zero_()
        row = 0
        for p, (part, rows) in enumerate(zip(self.parts, self.part_rows)):
            pair = weights.get(f"{self.prefix}.{part}")
            if pair is not None:
                a, b = pair
                name = f"{self.prefix}.{part}.weight"
                if part in ROW_PARALLEL:
                    a = share(name, a)
                else:
                    b = share(name, b)
                r = a.shape[0]
                column = p * self.max_rank
                self.a[slot, column:column + r] = a
                self.b[slot, row:row + rows, column:column + r] = b
            row += rows
        if packed is not None:
            self.packed_a[packed] = pack_linear_weight(self.a[0])
            self.packed_b[packed] = pack_linear_weight(self.b[0])

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base product of ``x``) plus each slot's delta on its rows; packed, by the
        kernels and in the rounding of the one-call forward (``x @ A.T`` rounded to bfloat16,
        its product with B added to ``out`` and rounded once)."""
        for slot, start, end in self.context.groups:
            if self.packed_a is not None:
                t = linear_kernels.packed_linear(x[start:end], self.packed_a[slot], None, self.width, self.tile_rows)
                linear_kernels.packed_linear_accumulate(t, self.packed_b[slot], out[start:end], self.tile_rows)
            else:
                out[start:end] += ((x[start:end] @ self.a[slot].T) @ self.b[slot].T).to(out.dtype)
        return out


class LoRAManager:
    """The worker's adapters: which are held (at most ``max_cpu_loras``), which sit in which of
    the ``max_loras`` slots, and the step's rows per slot.

    Args:
        model: The decoder (engine/models/decoder.py), before its weights are packed.
        max_loras: Slots: the most adapters one step runs.
        max_rank: The highest rank an adapter may have.
        max_cpu_loras: Adapters held beside the slots (least recently used dropped first).
    """

    def __init__(self, model, max_loras: int, max_rank: int, max_cpu_loras: int | None) -> None:
        from pagoda.engine.models.decoder import MLP, Attention

        self.context = LoRAContext()
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras or 0, max_loras)
        self.layers: list[LoRALayer] = []
        self._share = model._share_of
        dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
        max_rank += max_rank % 2  # NOTE: the blocked kernel multiplies pairs of input features
        packed = device.type == "cpu" and dtype == torch.bfloat16 and linear_kernels.packed_linear_available()
        for name, module in model.named_modules():
            if isinstance(module, Attention):
                shapes = {"qkv_proj": ([module.q_size, module.kv_size, module.kv_size], model.config.hidden_size),
                          "o_proj": ([model.config.hidden_size], module.q_size)}
            elif isinstance(module, MLP):
                inter = module.intermediate_size
                shapes = {"gate_up_proj": ([inter, inter], model.config.hidden_size),
                          "down_proj": ([model.config.hidden_size], inter)}
            else:
                continue
            for layer_name, (part_rows, in_features) in shapes.items():
                layer = LoRALayer(name, FUSED_PARTS[layer_name], part_rows, in_features, max_loras, max_rank, dtype,
                                  device, self.context, packed)
                getattr(module, layer_name).lora = layer
                self.layers.append(layer)
        self.held: OrderedDict[int, object] = OrderedDict()  # adapter id -> LoRAAdapter, oldest use first
        self.slot_ids: list[int | None] = [None] * max_loras
        self.slot_used = [0] * max_loras
        self.slot_loads = 0  # adapters put into a slot so far (an eviction each beyond max_loras)
        self._steps = 0

    def add(self, adapters: dict) -> None:
        """Takes the adapters the engine sent (id -> engine.lora.LoRAAdapter)."""
        for adapter_id, adapter in adapters.items():
            self.held[adapter_id] = adapter
            self.held.move_to_end(adapter_id)

    def drop(self, adapter_ids) -> None:
        """Forgets adapters the engine no longer needs here (unloaded, or beyond max_cpu_loras)."""
        for adapter_id in adapter_ids:
            self.held.pop(adapter_id, None)
            if adapter_id in self.slot_ids:
                self.slot_ids[self.slot_ids.index(adapter_id)] = None

    def begin_step(self, lora_ids: np.ndarray, query_lens: np.ndarray) -> bool:
        """Sets the step's runs of adapter rows from each scheduled request's adapter (0: none)
        and its token count, in batch order (the model runner puts each adapter's requests
        together); returns whether any row runs an adapter."""
        if not lora_ids.any():
            self.end_step()
            return False
        self._steps += 1
        needed = [int(i) for i in np.unique(lora_ids) if i]
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step runs {len(needed)} adapters; there are {self.max_loras} slots")
        slots = {adapter_id: self._slot(adapter_id, needed) for adapter_id in needed}
        ends = np.cumsum(query_lens)
        groups: list[tuple[int, int, int]] = []
        for adapter_id, start, end in zip(lora_ids.tolist(), (ends - query_lens).tolist(), ends.tolist()):
            if not adapter_id:
                continue
            slot = slots[adapter_id]
            if groups and groups[-1][0] == slot and groups[-1][2] == start:
                groups[-1] = (slot, groups[-1][1], end)
            else:
                groups.append((slot, start, end))
        self.context.groups = groups
        self.context.segments = torch.tensor(groups, dtype=torch.int64)
        return True

    def end_step(self) -> None:
        self.context.groups = self.context.segments = None

    def _slot(self, adapter_id: int, needed: list[int]) -> int:
        """The slot holding ``adapter_id``, filling the least recently used one not needed
        this step if it is in none."""
        if adapter_id in self.slot_ids:
            slot = self.slot_ids.index(adapter_id)
        else:
            adapter = self.held.get(adapter_id)
            if adapter is None:
                raise RuntimeError(f"LoRA adapter {adapter_id} was never sent to the worker")
            free = [s for s, held in enumerate(self.slot_ids) if held not in needed]
            slot = min(free, key=lambda s: (self.slot_ids[s] is not None, self.slot_used[s]))
            for layer in self.layers:
                layer.fill(slot, adapter.weights, self._share)
            self.slot_ids[slot] = adapter_id
            self.slot_loads += 1
            logger.debug("LoRA adapter %s (%s) into slot %d", adapter_id, adapter.name, slot)
        self.slot_used[slot] = self._steps
        self.held.move_to_end(adapter_id)
        return slot
