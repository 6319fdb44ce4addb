"""Gemma 2 and Gemma 3 (text): the Llama block with Gemma's parts. Every RMS norm multiplies by
1 + weight in float32; each layer also norms its attention's and its MLP's outputs before their
residual adds (a "sandwich"); the MLP's gate is GELU (tanh approximation); the embeddings are
scaled by sqrt(hidden); attention's scale comes from ``query_pre_attn_scalar``; layers alternate
between a sliding window and global attention (``layer_types``). Gemma 2 soft-caps attention
scores and the final logits; Gemma 3 norms each query and key head instead and gives its sliding
layers a RoPE base of their own.

The checkpoint's ``post_attention_layernorm`` is the attention output's norm and its
``pre_feedforward_layernorm`` the MLP input's, which the decoder calls ``attn_out_norm`` and
``post_attention_layernorm`` (Llama's name for the norm before the MLP).

llama.cpp's GGUF files store every norm's weight plus one, and leave out what its loader knows by
the model's size: which layers slide (every 2nd global for Gemma 2, every 6th for Gemma 3, unless
the file states the pattern) and the attention scale (hidden / heads for the 27B models, head_dim
for the others).
"""

from __future__ import annotations

from typing import Any

from pagoda.engine.families.family import Family


def _layer_types(raw: dict[str, Any], every: int) -> list[str]:
    """config.json's layer_types, or transformers' default: every ``every``-th layer global."""
    num_layers = int(raw["num_hidden_layers"])
    return raw.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                      for i in range(num_layers)]


def _gemma(raw: dict[str, Any], every: int) -> dict[str, Any]:
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an encoder) is not supported")
    types = _layer_types(raw, every)
    sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    window = raw.get("sliding_window") if sliding else None
    return {"attention_bias": bool(raw.get("attention_bias", False)),
            "sliding_window": window,
            "sliding_layers": sliding if window is not None and len(sliding) < len(types) else None,
            "norm_unit_offset": True, "sandwich_norms": True,
            "embedding_multiplier": float(raw["hidden_size"]) ** 0.5,
            "query_pre_attn_scalar": raw.get("query_pre_attn_scalar"),
            "attn_logit_softcapping": raw.get("attn_logit_softcapping"),
            "final_logit_softcapping": raw.get("final_logit_softcapping")}


def _gemma2(raw: dict[str, Any]) -> dict[str, Any]:
    return _gemma(raw, every=2)


def _gemma3(raw: dict[str, Any]) -> dict[str, Any]:
    params = raw.get("rope_parameters") or {}
    local = (params.get("sliding_attention") or {}).get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0
    return {**_gemma(raw, every=int(raw.get("sliding_window_pattern") or 6)), "qk_norm": True,
            "local_rope_theta": float(local)}


def _gguf(large_layers: int):
    """The GGUF reader of a Gemma generation whose 27B model has ``large_layers`` layers."""

    def read(meta, config: dict[str, Any]) -> dict[str, Any]:
        extra = {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": meta("attention.sliding_window"),
                 "attn_logit_softcapping": meta("attn_logit_softcapping"),
                 "final_logit_softcapping": meta("final_logit_softcapping")}
        pattern = meta("attention.sliding_window_pattern")
        if pattern is not None:
            extra["layer_types"] = ["sliding_attention" if slides else "full_attention" for slides in pattern]
        large = config["num_hidden_layers"] == large_layers
        extra["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"] if large
                                          else config["head_dim"])
        return extra

    return read


_GGUF_NAMES = (("post_attention_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
               ("post_ffw_norm", "post_feedforward_layernorm"))

_RENAMES = ((r"\.post_attention_layernorm\.", ".attn_out_norm."),
            (r"\.pre_feedforward_layernorm\.", ".post_attention_layernorm."),
            (r"\.post_feedforward_layernorm\.", ".mlp_out_norm."))

GEMMA2 = Family("gemma2", ("Gemma2ForCausalLM",), 8192, _gemma2, renames=_RENAMES, gguf_architecture="gemma2",
                gguf_names=_GGUF_NAMES, gguf_norm_offset=1.0, gguf_config=_gguf(large_layers=46))
GEMMA3 = Family("gemma3_text", ("Gemma3ForCausalLM",), 131072, _gemma3, renames=_RENAMES, gguf_architecture="gemma3",
                gguf_names=(*_GGUF_NAMES, ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")),
                gguf_norm_offset=1.0, gguf_config=_gguf(large_layers=62))
FAMILIES = (GEMMA2, GEMMA3)
