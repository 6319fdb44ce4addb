"""Limits in the units that cost: characters before tokenizing, sequences and tokens per
request, sequences and tokens in flight per client.

- A prompt longer than ``max_model_len`` x (the longest token's length in characters) cannot
  fit whatever its tokens, so it is refused before the tokenizer spends seconds on it.
- A request's cost is its sequences (prompts x n) and its tokens (each sequence's prompt plus
  max_tokens); a request over the per-request limits is a 400, a client whose requests in
  flight would pass the per-client limits gets a 429 with Retry-After.

The defaults follow the engine's size, so they are safe on a shared server and never refuse
what one engine step or a few full KV caches could hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagoda.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from pagoda.server.config import ServerConfig


@dataclass(slots=True)
class Limits:
    """The limits in force, resolved against the engine.

    Attributes:
        max_prompt_chars: Characters a prompt (or a conversation's text) may have.
        max_sequences_per_request: Prompts x n of one request (default: half of
            max_num_seqs, so that a request never holds every slot).
        max_tokens_per_request: Sum over its sequences of prompt + max_tokens (default:
            four times the KV cache's tokens).
        max_sequences_per_client: Sequences one client may have in flight (default: twice
            max_num_seqs).
        max_tokens_per_client: Tokens (as above) one client may have in flight (default:
            eight times the KV cache's tokens).
    """

    max_prompt_chars: int
    max_sequences_per_request: int
    max_tokens_per_request: int
    max_sequences_per_client: int
    max_tokens_per_client: int

    @classmethod
    def resolve(cls, config: ServerConfig, engine: Any) -> Limits:
        longest_token = max(map(len, engine.tokenizer.get_vocab()), default=1)
        max_num_seqs, kv_tokens = engine.config.max_num_seqs, engine.num_kv_tokens
        return cls(
            max_prompt_chars=engine.max_model_len * max(longest_token, 1),
            # NOTE: half the engine's slots, so that one request never holds all of them.
            max_sequences_per_request=config.max_sequences_per_request or max(1, max_num_seqs // 2),
            max_tokens_per_request=config.max_tokens_per_request or 4 * kv_tokens,
            max_sequences_per_client=config.max_sequences_per_client or 2 * max_num_seqs,
            max_tokens_per_client=config.max_tokens_per_client or 8 * kv_tokens,
        )

    def check_chars(self, num_chars: int, param: str) -> None:
        """400 for text too long to fit the context whatever its tokens (before tokenizing)."""
        if num_chars > self.max_prompt_chars:
            raise bad_request(
                f"The prompt is {num_chars} characters long; this model's context cannot hold more than "
                f"{self.max_prompt_chars} (its maximum context length times its longest token). Shorten it.",
                param, code="context_length_exceeded")

    def check_sequences(self, num_sequences: int, param: str = "n") -> None:
        """400 for a request with more sequences (prompts x n, or inputs) than one may have."""
        if num_sequences > self.max_sequences_per_request:
            raise bad_request(
                f"This request asks for {num_sequences} sequences (prompts x n, or inputs); at most "
                f"{self.max_sequences_per_request} are allowed per request (--max-sequences-per-request).",
                param, code="too_many_sequences")

    def check_tokens(self, num_tokens: int, param: str) -> None:
        """400 for a request that asks for more tokens than one may."""
        if num_tokens > self.max_tokens_per_request:
            raise bad_request(
                f"This request asks for {num_tokens} tokens (each sequence's prompt plus max_tokens); at most "
                f"{self.max_tokens_per_request} are allowed per request (--max-tokens-per-request). Lower "
                "max_tokens or n.", param, code="too_many_tokens")


class ClientBudget:
    """Sequences and tokens in flight per client; 429 past the limits.

    Args:
        limits: The per-client limits.
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._inflight: dict[str, tuple[int, int]] = {}

    def charge(self, client: str, num_sequences: int, num_tokens: int) -> None:
        """Counts a request in.

        Raises:
            APIError: 429 with Retry-After when the client would pass a limit (a request
                alone is never refused here: check_sequences and check_tokens bound it).
        """
        sequences, tokens = self._inflight.get(client, (0, 0))
        limits = self.limits
        if sequences and (sequences + num_sequences > limits.max_sequences_per_client
                          or tokens + num_tokens > limits.max_tokens_per_client):
            raise APIError(429, f"This client has {sequences} sequences and {tokens} tokens in flight; with this "
                                f"request it would pass the per-client limits ({limits.max_sequences_per_client} "
                                f"sequences, {limits.max_tokens_per_client} tokens: --max-sequences-per-client, "
                                f"--max-tokens-per-client). Retry when some finish.",
                           code="too_many_requests", headers={"Retry-After": "1"})
        self._inflight[client] = (sequences + num_sequences, tokens + num_tokens)

    def check_room(self, client: str) -> None:
        """429 for a client already at a limit, before its request is tokenized."""
        sequences, tokens = self._inflight.get(client, (0, 0))
        limits = self.limits
        if sequences >= limits.max_sequences_per_client or tokens >= limits.max_tokens_per_client:
            raise APIError(429, f"This client has {sequences} sequences and {tokens} tokens in flight, at its "
                                f"limits ({limits.max_sequences_per_client} sequences, "
                                f"{limits.max_tokens_per_client} tokens). Retry when some finish.",
                           code="too_many_requests", headers={"Retry-After": "1"})

    def release(self, client: str, num_sequences: int, num_tokens: int) -> None:
        sequences, tokens = self._inflight.get(client, (0, 0))
        sequences, tokens = sequences - num_sequences, tokens - num_tokens
        if sequences > 0:
            self._inflight[client] = (sequences, tokens)
        else:
            self._inflight.pop(client, None)

    def inflight(self, client: str) -> tuple[int, int]:
        """(sequences, tokens) the client has in flight."""
        return self._inflight.get(client, (0, 0))
