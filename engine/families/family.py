"""What a model family is: an architecture described, not programmed.

A family names the Hugging Face architectures it reads, says which of the decoder's building
blocks it uses (engine/models/decoder.py builds every family from the same parts: RMS norms,
grouped-query attention with optional per-head q/k norms, a gated MLP or a mixture of experts,
RoPE with its scalings, a tied or untied head), reads the keys of its ``config.json`` that say
so, and names its checkpoint tensors where they differ from the decoder's own names (the Llama
names, ``model.layers.N.self_attn.q_proj.weight``, ...).

Nothing here imports torch: the engine process reads a family to build the ModelConfig it
sizes the KV cache with, and the worker reads the same family to load the weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

def used_sliding_window(raw: dict[str, Any]) -> int | None:
    """The window of a config that has one but turns it on by ``use_sliding_window`` (Qwen2, Qwen3)."""
    return raw.get("sliding_window") if raw.get("use_sliding_window") else None


#: A fused checkpoint tensor and what it is cut into: (pattern, [(part name, size key)...]).
#: The sizes are read from the model configuration (see Family.split_fused).
FusedTensor = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: Pagoda's name of the architecture (ModelConfig.architecture), e.g. ``"qwen3"``.
        architectures: The Hugging Face ``architectures`` entries it reads.
        default_max_positions: The context length when config.json does not say (the
            transformers config class's default).
        read_config: config.json -> the ModelConfig fields this family sets beyond the common
            ones (attention bias, q/k norms, experts, sliding window); raises ValueError for
            a variant it does not run.
        renames: (regex, replacement) pairs applied in order to each checkpoint tensor's
            name (after the leading ``model.`` is dropped) to reach the decoder's names.
        fused: Checkpoint tensors holding several of the decoder's parts along their first
            dimension (Phi-3's qkv_proj and gate_up_proj), with the config fields that give
            each part's rows.
        moe: Whether its layers' MLPs are mixtures of experts (a GGUF file says so by its
            ``<arch>.expert_count``: llama.cpp writes Mixtral as a "llama" file with experts).
        gguf_architecture: llama.cpp's ``general.architecture`` for this family's GGUF files,
            or None where Pagoda does not read them.
        gguf_permutes_qk: Whether llama.cpp's converter permuted q and k's rows (its Llama
            converter does, for the interleaved RoPE; Qwen's do not).
        gguf_names: llama.cpp's names of a layer's tensors (``blk.N.<name>.weight``) -> this
            family's Hugging Face names, where they differ from the Llama ones; "{}" in a name
            stands for the expert (llama.cpp stacks a layer's experts in one 3-D tensor).
        gguf_norm_offset: What llama.cpp's converter added to every norm's weight (Gemma's
            checkpoints store w of a norm that multiplies by 1 + w; its GGUF files 1 + w).
        gguf_config: The config.json keys this family reads from a GGUF file's metadata beyond
            the common ones: (``meta``, the common config) -> keys, where ``meta(key)`` is the
            file's ``<arch>.<key>`` or None.
    """

    name: str
    architectures: tuple[str, ...]
    default_max_positions: int
    read_config: Callable[[dict[str, Any]], dict[str, Any]] = lambda raw: {}
    renames: tuple[tuple[str, str], ...] = ()
    fused: tuple[FusedTensor, ...] = ()
    moe: bool = False
    gguf_architecture: str | None = None
    gguf_permutes_qk: bool = False
    gguf_names: tuple[tuple[str, str], ...] = ()
    gguf_norm_offset: float = 0.0
    gguf_config: Callable[[Callable[[str], Any], dict[str, Any]], dict[str, Any]] | None = None

    def checkpoint_name(self, name: str) -> str:
        """The decoder's name of a checkpoint tensor (``model.`` already stripped)."""
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)  # NOTE: re caches the compiled patterns
        return name

    def split_fused(self, name: str, rows: dict[str, int]) -> list[tuple[str, int]] | None:
        """How a fused tensor ``name`` is cut: [(part's name, rows)...] in order, or None for a
        tensor that is not fused. ``rows`` maps each size key to its number of rows."""
        for suffix, parts in self.fused:
            if name.endswith(suffix):
                # "layers.3.mlp.gate_up_proj.weight" -> "layers.3.mlp." + part + ".weight"
                stem, _, tail = name.rsplit(".", 2)
                return [(f"{stem}.{part}.{tail}", rows[key]) for part, key in parts]
        return None
