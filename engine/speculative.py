"""Speculative decoding's configuration (``--speculative-config``), read by both processes.

How drafts are proposed and verified: engine/core/drafting.py and the model runner; the
whole story in docs/speculative-decoding.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    """``--speculative-config`` (vLLM's keys).

    Attributes:
        method: "ngram" (prompt lookup) or "draft_model" (a smaller model with the same
            vocabulary proposes, greedily, in the same worker).
        model: The draft model (a directory, a .gguf file, or ``default``), for draft_model.
        num_speculative_tokens: Drafts proposed per step (k).
        prompt_lookup_min: Shortest n-gram matched.
        prompt_lookup_max: Longest n-gram matched (tried first).
        min_acceptance: Below this share of drafts accepted (over ``window`` proposals),
            a request stops proposing for a while, so text that prompt lookup cannot
            predict costs next to nothing.
        window: Proposals the acceptance is measured over.
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    min_acceptance: float = 0.2
    window: int = 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}; got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer; got {value!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError(f"speculative_config num_speculative_tokens must be at most 16; got "
                             f"{self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config prompt_lookup_min must not exceed prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model': the draft model's directory "
                             "or .gguf file")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config 'model' is for method 'draft_model'; 'ngram' drafts from the "
                             "request's own tokens")
        if not 0 <= self.min_acceptance <= 1:
            raise ValueError(f"speculative_config min_acceptance must be in [0, 1]; got {self.min_acceptance!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict, its JSON text, or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be an object; got {type(value).__name__}")
        known = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "min_acceptance",
                 "window"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**value)
