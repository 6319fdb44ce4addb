"""The Llama family: Llama 1-3.x, SmolLM, Mistral and Qwen2 (one block: RMS norms, grouped-query
attention, SwiGLU MLP, RoPE with Llama 3.1's, YaRN's, linear or dynamic scaling)."""

from __future__ import annotations

from typing import Any

from pagoda.engine.families.family import Family, used_sliding_window


def _llama(raw: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": bool(raw.get("attention_bias", False))}


def _mistral(raw: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": False, "sliding_window": raw.get("sliding_window")}


def _qwen2(raw: dict[str, Any]) -> dict[str, Any]:
    # NOTE: Qwen2 always has q/k/v biases; its config has no key for it.
    return {"attention_bias": bool(raw.get("attention_bias", True)),
            "sliding_window": used_sliding_window(raw)}


LLAMA = Family("llama", ("LlamaForCausalLM",), 2048, _llama, gguf_architecture="llama", gguf_permutes_qk=True)
MISTRAL = Family("mistral", ("MistralForCausalLM",), 4096 * 32, _mistral)
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), 32768, _qwen2, gguf_architecture="qwen2")
FAMILIES = (LLAMA, MISTRAL, QWEN2)
