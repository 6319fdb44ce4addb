"""Model configuration read from a Hugging Face style ``config.json``.

`ModelConfig` is the engine's own, framework-free view of a decoder-only
checkpoint: the numbers the model code, the KV cache sizing and the RoPE
computation need. It is built by `ModelConfig.from_dir`, which accepts both the
transformers-4 layout (``rope_theta`` / ``rope_scaling`` at the top level) and
the transformers-5 layout (one ``rope_parameters`` dict).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.engine.families import BY_ARCHITECTURE, FAMILIES

#: ``architectures`` entries we can run, mapped to our architecture name (engine/families).
#: NOTE: the SmolLM / SmolLM2 checkpoints are ``LlamaForCausalLM``.
SUPPORTED_ARCHITECTURES: dict[str, str] = {arch: family.name for arch, family in BY_ARCHITECTURE.items()}

#: RoPE variants implemented by `engine.models.rope.compute_inv_freq`.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Types whose parameters need the pretraining context length.
_ROPE_TYPES_WITH_ORIGINAL_MAX = ("llama3", "yarn", "longrope")
# Older names of a RoPE type in configs ("su": Phi-3's first 128k checkpoints).
_ROPE_TYPE_ALIASES = {"su": "longrope"}


@dataclass(slots=True)
class ModelConfig:
    """Architecture hyperparameters of a supported decoder-only model.

    Attributes:
        architecture: The family's name (engine/families: ``"llama"``, ``"qwen3"``,
            ``"mixtral"``, ...).
        vocab_size: Rows of the embedding and LM head.
        hidden_size: Residual stream width.
        intermediate_size: Width of the SwiGLU MLP (of the dense layers, in a
            mixture-of-experts model).
        num_hidden_layers: Number of decoder layers.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (grouped-query attention).
        head_dim: Per-head dimension (``hidden_size // num_attention_heads``
            unless the checkpoint says otherwise).
        rms_norm_eps: Epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: RoPE scaling parameters, or ``None`` for plain RoPE.
            Always holds a ``"rope_type"`` key when not ``None`` (the legacy
            ``"type"`` key is translated); never holds ``"rope_theta"``.
        max_position_embeddings: Context length the model was configured for.
        tie_word_embeddings: Whether the LM head reuses the embedding matrix.
        attention_bias: Whether q/k/v projections carry a bias (``o_proj``
            never does for the supported architectures).
        bos_token_id: Beginning-of-sequence id, ``None`` when absent.
        eos_token_ids: Every id that ends generation (config.json and
            generation_config.json merged, in order, without duplicates).
        sliding_window: Sliding attention window, ``None`` when attention is
            global. NOTE: only set when the checkpoint really uses it (Mistral
            v0.1, Qwen2 with ``use_sliding_window``), so callers can reject it.
        qk_norm: Whether each query and key head goes through an RMS norm of its
            own (``q_norm``, ``k_norm``) before RoPE (Qwen3).
        num_experts: Experts of each sparse layer's MLP; 0 for a dense model.
        num_experts_per_tok: Experts each token is routed to (top k).
        moe_intermediate_size: Width of each expert's SwiGLU MLP.
        norm_topk_prob: Whether the top k routing weights are renormalized to sum to 1.
        dense_mlp_layers: Layers of a mixture-of-experts model that keep a dense MLP.
        sliding_layers: The layers that attend within ``sliding_window`` where only some
            do (Gemma); None where the window, if any, applies to every layer.
        hidden_act: The MLP's gate activation: ``"silu"`` or ``"gelu_pytorch_tanh"`` (GeGLU).
        norm_unit_offset: Whether every RMS norm multiplies by ``1 + weight``, in float32
            (Gemma), rather than by ``weight`` after casting back (Llama).
        sandwich_norms: Whether each layer also norms the attention's and the MLP's outputs
            before their residual adds (Gemma's post-attention and post-feedforward norms).
        embedding_multiplier: What the embeddings are multiplied by (Gemma: sqrt(hidden)).
        query_pre_attn_scalar: Attention's softmax scale is its -1/2 power (None: head_dim's).
        attn_logit_softcapping: Attention scores s become cap * tanh(s / cap) (None: not).
        final_logit_softcapping: The same for the LM head's logits.
        local_rope_theta: The RoPE base of the sliding layers where it differs (Gemma 3).
        partial_rotary_factor: The share of each head that RoPE rotates (Phi-4-mini: 0.75).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_mlp_layers: tuple[int, ...] = ()
    sliding_layers: tuple[int, ...] | None = None
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    embedding_multiplier: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.architecture not in FAMILIES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; expected one of {sorted(FAMILIES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] and give an "
                             f"even number of rotated dimensions of the {self.head_dim} of a head")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, "
                                 f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope_type {rope_type!r}; expected one of {SUPPORTED_ROPE_TYPES}"
                )

    @property
    def attention_scale(self) -> float:
        """The softmax scale of attention."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def windowed_everywhere(self) -> bool:
        """Whether every layer attends within ``sliding_window`` (then no request needs more than
        the window's keys; where only some layers do, the others need every key)."""
        return self.sliding_window is not None and self.sliding_layers is None

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window (None: it sees every earlier token)."""
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    @property
    def is_moe(self) -> bool:
        """Whether some layers' MLP is a mixture of experts."""
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head that RoPE rotates, the first ones (Phi-4-mini's
        partial_rotary_factor rotates three quarters); the others pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_type(self) -> str:
        """The RoPE variant, ``"default"`` when there is no scaling."""
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Reads ``config.json`` (and ``generation_config.json`` if present).

        Args:
            path: A Hugging Face style model directory.

        Returns:
            The parsed configuration.

        Raises:
            FileNotFoundError: If ``config.json`` is missing.
            ValueError: If the model type, architecture or a feature (MLP bias,
                activation, RoPE type) is not supported, or a value is invalid.
        """
        path = Path(path)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        raw = json.loads(config_path.read_text(encoding="utf-8"))
        generation: dict[str, Any] = {}
        generation_path = path / "generation_config.json"
        if generation_path.is_file():
            generation = json.loads(generation_path.read_text(encoding="utf-8"))
        return cls.from_dict(raw, generation, source=str(config_path))

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        generation: dict[str, Any] | None = None,
        *,
        source: str = "config",
    ) -> ModelConfig:
        """Builds a config from parsed ``config.json`` contents.

        Args:
            raw: The ``config.json`` dict.
            generation: The ``generation_config.json`` dict, if any.
            source: Where ``raw`` came from, used in error messages.

        Returns:
            The parsed configuration.

        Raises:
            ValueError: As for `from_dir`.
        """
        architecture = _architecture(raw, source)
        family = FAMILIES[architecture]
        if raw.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        hidden_act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
        if hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu' and "
                             "'gelu_pytorch_tanh')")

        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        max_positions = int(raw.get("max_position_embeddings") or family.default_max_positions)
        rope_theta, rope_scaling, partial_rotary_factor = _rope(raw, max_positions, source)
        try:
            extra = family.read_config(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: a {architecture} config needs {exc}") from None
        if extra.get("sliding_window") is not None:
            extra["sliding_window"] = int(extra["sliding_window"])

        eos_ids: list[int] = []
        for value in (raw.get("eos_token_id"), (generation or {}).get("eos_token_id")):
            for token_id in _as_id_list(value):
                if token_id not in eos_ids:
                    eos_ids.append(token_id)
        bos = raw.get("bos_token_id")
        if bos is None and generation:
            bos = generation.get("bos_token_id")

        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            hidden_act=hidden_act,
            partial_rotary_factor=partial_rotary_factor,
            **{"attention_bias": False, **extra},
        )


def _architecture(raw: dict[str, Any], source: str) -> str:
    """Maps ``architectures`` / ``model_type`` to our architecture name."""
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    supported_types = sorted(FAMILIES)
    if architectures:
        unknown = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
        if unknown:
            raise ValueError(
                f"{source}: unsupported architectures {unknown}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = SUPPORTED_ARCHITECTURES[architectures[0]]
        if model_type is not None and model_type != architecture:
            raise ValueError(
                f"{source}: model_type {model_type!r} does not match architectures {architectures}"
            )
        return architecture
    if model_type in supported_types:
        return model_type
    raise ValueError(
        f"{source}: unsupported model_type {model_type!r} (no architectures given); "
        f"supported: {supported_types}"
    )


def _rope(raw: dict[str, Any], max_positions: int, source: str) -> tuple[float, dict | None, float]:
    """Returns ``(rope_theta, rope_scaling, partial_rotary_factor)`` from either config layout."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{source}: rope_parameters must be an object")
    if params and any(isinstance(v, dict) for v in params.values()):
        # NOTE: one entry per layer type (Gemma 3 in transformers 5): the full-attention layers'
        # is the model's; the sliding layers' base is read by the family (local_rope_theta).
        params = params.get("full_attention")
        if not isinstance(params, dict):
            raise ValueError(f"{source}: per-layer-type rope_parameters without a full_attention entry")
    scaling = dict(params or raw.get("rope_scaling") or {})
    partial = float(scaling.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor") or 1.0)
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = raw.get("rope_theta", 10000.0)
    # Legacy configs say "type"; transformers normalizes to "rope_type".
    legacy_type = scaling.pop("type", None)
    rope_type = scaling.pop("rope_type", None) or legacy_type or "default"
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type == "default":
        return float(theta), None, partial
    if rope_type in _ROPE_TYPES_WITH_ORIGINAL_MAX:
        original = raw.get("original_max_position_embeddings", max_positions)
        scaling.setdefault("original_max_position_embeddings", original)
    return float(theta), {"rope_type": rope_type, **scaling}, partial


def _as_id_list(value: Any) -> list[int]:
    """Normalizes an ``int | list[int] | None`` token id field."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
