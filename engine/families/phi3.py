"""Phi-3 (mini and medium, 4k and 128k), Phi-3.5-mini and Phi-4-mini: the Llama block whose
checkpoint stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``, cut into the
decoder's parts as they load. The 128k models' LongRoPE and Phi-4-mini's RoPE over part of each
head are read with the common RoPE fields (engine/model_config.py)."""

from __future__ import annotations

from typing import Any

from pagoda.engine.families.family import Family


def _phi3(raw: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": False, "sliding_window": raw.get("sliding_window")}


PHI3 = Family(
    "phi3", ("Phi3ForCausalLM",), 4096, _phi3, gguf_architecture="phi3",
    gguf_names=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj")),
    fused=(("self_attn.qkv_proj.weight", (("q_proj", "q"), ("k_proj", "kv"), ("v_proj", "kv"))),
           ("mlp.gate_up_proj.weight", (("gate_proj", "intermediate"), ("up_proj", "intermediate")))))
FAMILIES = (PHI3,)
