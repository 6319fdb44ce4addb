"""Structured outputs in the engine process: grammars compiled by llguidance, one matcher per
request, and each step's token bitmask.

Why llguidance (measured on this project's Intel Xeon with AMX, SmolLM2's 49,152-token
vocabulary, a nested JSON schema; the table is in docs/structured-outputs.md): it has no
dependencies and fills numpy bitmasks, so the engine's core stays free of torch (xgrammar
needs torch and, on Linux, triton, and takes 2.3 s to import against 0.7 s); it compiled
the schema in 3 ms against xgrammar's 18 ms, which matters when every agent request brings
its own schema; its per-token mask took 20 us (median) against xgrammar's 2 us, which for 64
structured requests came to about 0.8 ms of a 75 ms step, computed by a thread pool that
releases the GIL.

The mechanism: :class:`GrammarCompiler` turns a request's StructuredOutputsParams into a
matcher (compiled once per distinct constraint, then copied per request); the scheduler
asks :func:`fill_bitmasks` for the rows of the step's sampling structured requests and
sends them with the step; the worker masks those rows' logits before sampling; the
scheduler advances each matcher with the token it gets back. llguidance and numpy are
imported on first use, so requests without a grammar pay nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pagoda.engine.core.json_schema import generation_schema
from pagoda.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance
    import numpy as np

#: Distinct compiled constraints kept (agent frameworks send a few schemas over and over).
CACHE_SIZE = 256


class GrammarCompiler:
    """Compiles constraints into llguidance matchers for one tokenizer, with a cache.

    Args:
        hf_tokenizer: The model's (fast) Hugging Face tokenizer.
        vocab_size: Width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_ids: The ids that end generation (a complete grammar allows only them).

    Attributes:
        num_compiles: Constraints compiled (cache misses).
        compile_seconds: Time spent compiling them.
        num_requests: Structured requests seen (one per call of :meth:`matchers`).
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        # NOTE: compiles run on worker threads of the event loop (the server's) as well as
        # on the loop itself (the offline LLM): the cache and counters are shared.
        self._lock = threading.Lock()
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self.num_requests = 0

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf

            # NOTE: about half a second, once, at the first structured request.
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self._eos_token_ids or None)
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The pristine matcher of a constraint, compiled on the first call and cached.

        Raises:
            ValueError: The schema, regex or grammar is invalid or unsupported; the message
                starts with ``structured_outputs`` and says what is wrong.
        """
        import llguidance

        key = params.cache_key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        start = time.perf_counter()
        grammar = grammar_text(params)
        tokenizer = self._llg_tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs: {_kind(params)} is not valid or not supported: {messages[0]}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {_kind(params)} is not valid: {matcher.get_error()}")
        probe = matcher.deep_copy()
        probe.compute_bitmask()  # NOTE: one mask: a constraint that allows no output at all is known here
        if probe.is_error():
            raise ValueError(f"structured_outputs: {_kind(params)} allows no output "
                             f"({probe.get_error().splitlines()[0]})")
        with self._lock:
            self.num_compiles += 1
            self.compile_seconds += time.perf_counter() - start
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def matchers(self, params: StructuredOutputsParams, n: int) -> list[llguidance.LLMatcher]:
        """Fresh matchers for the ``n`` samples of one request (copies of the cached one).

        Raises:
            ValueError: As compile().
        """
        pristine = self.compile(params)
        with self._lock:
            self.num_requests += 1
        return [pristine.deep_copy() for _ in range(n)]


def _kind(params: StructuredOutputsParams) -> str:
    if params.json is not None or params.json_object:
        return "the JSON schema"
    if params.regex is not None:
        return "the regex"
    if params.choice is not None:
        return "the choice"
    if params.grammar is not None:
        return "the grammar"
    return "the structural tag"


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (a JSON schema read as
    engine/core/json_schema.py says: closed objects, compact whitespace, bounded numbers).

    Raises:
        ValueError: The constraint cannot be turned into a grammar (bad JSON text, a
            structural tag of the wrong shape, a grammar in no known syntax).
    """
    from llguidance import LLMatcher, StructTag, grammar_from

    try:
        if params.json_object:
            return LLMatcher.grammar_from_json_schema(generation_schema({"type": "object"}))
        if params.json is not None:
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            return LLMatcher.grammar_from_json_schema(generation_schema(schema))
        if params.regex is not None:
            return LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            return grammar_from("choice", json.dumps(params.choice))
        if params.grammar is not None:
            return grammar_from("grammar", params.grammar)
        tag = json.loads(params.structural_tag) if isinstance(params.structural_tag, str) else params.structural_tag
        tags = [StructTag(trigger=next(t for t in tag["triggers"] if s["begin"].startswith(t)), begin=s["begin"],
                          grammar=generation_schema(s.get("schema", True)), end=s.get("end", ""))
                for s in tag["structures"]]
        return StructTag.to_grammar(tags)
    except (ValueError, TypeError, KeyError, StopIteration, AssertionError) as exc:
        raise ValueError(f"structured_outputs: {_kind(params)} is not valid: {exc}") from None


class BitmaskFiller:
    """Fills the token bitmasks of a step's structured requests, in parallel.

    Args:
        vocab_size: Width of the model's logits.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._executor = None

    def fill(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """One int32 row of ``ceil(vocab_size / 32)`` words per matcher (bit i of word w
        allows token 32 w + i)."""
        import llguidance
        import llguidance.numpy as llg_numpy

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bitmask = llg_numpy.allocate_token_bitmask(len(matchers), self.vocab_size)
        llg_numpy.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return bitmask
