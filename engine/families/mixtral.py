"""Mixtral: the Mistral block whose MLP is a mixture of experts (softmax over the router's logits,
the top k renormalized); its checkpoint names the experts' products w1 (gate), w3 (up), w2 (down)
under ``block_sparse_moe``."""

from __future__ import annotations

from typing import Any

from pagoda.engine.families.family import Family


def _mixtral(raw: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": False, "sliding_window": raw.get("sliding_window"),
            "num_experts": int(raw.get("num_local_experts") or raw.get("num_experts") or 0),
            "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["intermediate_size"]),
            "norm_topk_prob": True}


MIXTRAL = Family(
    "mixtral", ("MixtralForCausalLM",), 4096 * 32, _mixtral, moe=True, gguf_architecture="llama",
    gguf_permutes_qk=True,
    gguf_names=(("ffn_gate_inp", "block_sparse_moe.gate"), ("ffn_gate_exps", "block_sparse_moe.experts.{}.w1"),
                ("ffn_up_exps", "block_sparse_moe.experts.{}.w3"), ("ffn_down_exps", "block_sparse_moe.experts.{}.w2")),
    renames=((r"\.block_sparse_moe\.", ".mlp."),
             (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
             (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
             (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj.")))
FAMILIES = (MIXTRAL,)
