"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

# NOTE: limits that keep one request from monopolising the engine; the server maps a
# violation to a 400 naming the field.
MAX_LOGPROBS = 20
MAX_N = 128
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 128
#: How an embedding pools a prompt's final hidden states into one vector.
POOLING_METHODS = ("last", "mean", "cls")


@dataclass(slots=True)
class SamplingParams:
    """How tokens are chosen for one request, and when it stops.

    Attributes:
        n: Number of samples generated for the prompt.
        temperature: 0 means greedy; higher flattens the distribution.
        top_p: Nucleus sampling mass in (0, 1].
        top_k: Keep the k most likely tokens; 0 or -1 disables.
        min_p: Drop tokens whose probability is below ``min_p`` times the top one.
        seed: Makes this request's samples reproducible, whatever it is batched with.
        repetition_penalty: Multiplicative penalty (> 0) on tokens seen in prompt or output.
        presence_penalty: Additive penalty on tokens present in the output, in [-2, 2].
        frequency_penalty: Additive penalty scaled by output counts, in [-2, 2].
        max_tokens: Maximum number of generated tokens; None means up to max_model_len.
        min_tokens: EOS and stop tokens are suppressed until this many tokens exist.
        stop: Strings that end generation; the match is left out of the text.
        stop_token_ids: Token ids that end generation (kept out of the text).
        ignore_eos: Keep generating past EOS.
        logprobs: Number of top logprobs returned per token (None: none; 0: only the
            sampled token's).
        prompt_logprobs: Number of top logprobs returned per prompt token (None: none; 0:
            only the prompt token's own). Each prompt token after the first is scored from
            the positions before it; the first has none. Such a request computes its whole
            prompt (no prefix-cache hits) and scores it during prefill.
        skip_special_tokens: Leave special tokens out of the detokenized text.
        include_stop_str_in_output: Keep a matched stop string in the text.
        structured_outputs: Constrain the output to a JSON schema, a regex, a choice or a
            grammar (see StructuredOutputsParams; a dict of its fields is taken too).
        logit_bias: Token id -> a value in [-100, 100] added to its logit before sampling
            (OpenAI's ``logit_bias``; -100 in practice bans the token, 100 forces it).
        allowed_token_ids: Only these tokens may be generated (vLLM's).
        bad_words: Words never generated: each word's last token is suppressed wherever the
            output ends with the tokens before it (the word tokenized with and without a
            leading space, as vLLM does).
        bad_words_token_ids: ``bad_words`` tokenized, set by the engine when it takes the
            request.
        pooling: Set by the embedding paths (``LLM.embed``, ``/v1/embeddings``): the request
            also returns its prompt's final hidden states pooled into one vector ("last":
            the last token's, "mean": the average, "cls": the first token's). Mean and cls
            compute the whole prompt (no prefix-cache hits).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", f"must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        _check(_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        _check(_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1), "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative integers")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and not isinstance(self.prompt_logprobs, bool)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to numbers")
            try:
                self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias must map token ids (integers, or their strings) to numbers") from None
            _check(all(t >= 0 and -100 <= v <= 100 for t, v in self.logit_bias.items()), "logit_bias",
                   "values must be in [-100, 100], for non-negative token ids")
            _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"may bias at most {MAX_LOGIT_BIAS} tokens")
        if self.allowed_token_ids is not None:
            _check(isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                   and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids), "allowed_token_ids",
                   "must be a non-empty list of non-negative token ids")
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                   "bad_words", "must be a list of non-empty strings")
            _check(len(self.bad_words) <= MAX_BAD_WORDS, "bad_words", f"may hold at most {MAX_BAD_WORDS} words")
        _check(self.pooling in (None, *POOLING_METHODS), "pooling",
               f"must be one of {', '.join(POOLING_METHODS)}, got {self.pooling!r}")

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt position must run in this request (prefix-cache hits skip
        positions whose scores or hidden states it needs)."""
        return self.prompt_logprobs is not None or self.pooling in ("mean", "cls")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class StructuredOutputsParams:
    """What the output must match; exactly one field is set (vLLM's ``structured_outputs``).

    Attributes:
        json: A JSON schema (a dict, or its JSON text): the output is one JSON value that
            validates against it.
        json_object: Any JSON object (``response_format: {"type": "json_object"}``).
        regex: A regular expression the whole output matches.
        choice: The output is exactly one of these strings.
        grammar: A grammar in Lark syntax (llguidance's dialect; EBNF as Lark writes it).
        structural_tag: llguidance's structural tag (a dict or its JSON text): free text in
            which a trigger such as ``<tool_call>`` starts a constrained part.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object else [])
        _check(len(given) == 1, "structured_outputs",
               f"must set exactly one of json, json_object, regex, choice, grammar, structural_tag; got {given or 'none'}")
        if self.choice is not None:
            _check(isinstance(self.choice, list) and self.choice and all(isinstance(c, str) for c in self.choice),
                   "structured_outputs", "choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value), "structured_outputs",
                   f"{name} must be a non-empty string")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, (dict, str)), "structured_outputs",
                   f"{name} must be an object or its JSON text")

    def cache_key(self) -> str:
        """A key that is equal for equal constraints (dicts compared by content)."""
        import json as jsonlib

        return jsonlib.dumps([self.json, self.json_object, self.regex, self.choice, self.grammar,
                              self.structural_tag], sort_keys=True)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
