"""Qwen3, dense and mixture-of-experts: the Llama block with an RMS norm over each query and key
head before RoPE (q_norm, k_norm) and no q/k/v bias; Qwen3-MoE replaces the MLP of its sparse
layers by a router over experts (softmax, top k, renormalized where ``norm_topk_prob``)."""

from __future__ import annotations

from typing import Any

from pagoda.engine.families.family import Family, used_sliding_window


def _qwen3(raw: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": bool(raw.get("attention_bias", False)), "qk_norm": True,
            "sliding_window": used_sliding_window(raw)}


def _qwen3_moe(raw: dict[str, Any]) -> dict[str, Any]:
    num_layers = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    # NOTE: transformers' rule: layer i is sparse when (i + 1) % step == 0 and it is not listed.
    dense |= {i for i in range(num_layers) if (i + 1) % step}
    return {**_qwen3(raw),
            "num_experts": int(raw.get("num_experts") or raw.get("num_local_experts") or 0),
            "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["moe_intermediate_size"]),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "dense_mlp_layers": tuple(sorted(dense))}


_QK_NORMS = (("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"))

QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), 32768, _qwen3, gguf_architecture="qwen3", gguf_names=_QK_NORMS)
QWEN3_MOE = Family(
    "qwen3_moe", ("Qwen3MoeForCausalLM",), 32768, _qwen3_moe, moe=True, gguf_architecture="qwen3moe",
    gguf_names=(*_QK_NORMS, ("ffn_gate_inp", "mlp.gate"), ("ffn_gate_exps", "mlp.experts.{}.gate_proj"),
                ("ffn_up_exps", "mlp.experts.{}.up_proj"), ("ffn_down_exps", "mlp.experts.{}.down_proj")))
FAMILIES = (QWEN3, QWEN3_MOE)
