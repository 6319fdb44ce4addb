"""Reasoning models' thinking, told apart from their answer (``--reasoning-parser``).

Models of the ``<think>…</think>`` family write their thinking first and the answer after
the closing tag. The server returns the two apart (``message.reasoning_content`` and
``message.content``, streamed as deltas of each); the engine holds a structured-output
grammar back until the thinking ends (unless the prompt's last tag already closed it), so
the constraint applies to the answer alone, as in vLLM. Both read the definitions here (a
leaf module: no torch, nothing of the engine's).

- ``deepseek_r1``: the output starts inside the thinking (the chat template opens it);
  a leading ``<think>`` is dropped; all text before ``</think>`` is reasoning, and an output
  that never closes it is all reasoning.
- ``qwen3``: the output is thinking only if it starts with ``<think>`` (Qwen3 with
  ``enable_thinking`` off, or a model that chose not to think, answers directly).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WHITESPACE = " \t\n\r"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """One family's tags and where its output starts.

    Attributes:
        name: The --reasoning-parser name.
        start: The tag that opens the thinking.
        end: The tag that closes it.
        starts_inside: The output begins inside the thinking, with or without ``start``.
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_inside: bool = False

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, content) of an output so far; ``final`` when it is whole.

        Called on a growing text, both parts only grow (a tail that may still become a
        tag is held back until it is clear), so a stream sends the differences.
        Reasoning is None for an output that does not think.
        """
        body = text.lstrip(WHITESPACE)
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not final and self.start.startswith(body):
            return None, ""  # it may still open with the tag
        elif not self.starts_inside:
            return None, text
        end = body.find(self.end)
        if end >= 0:
            return body[:end], body[end + len(self.end):].lstrip(WHITESPACE)
        if final:
            return body, ""
        return body[:_tag_prefix_at(body, self.end)], ""

    def is_thinking(self, prompt_ids: list[int], start_ids: Sequence[int], end_ids: Sequence[int]) -> bool:
        """Whether the model may still think after this prompt: unless the prompt's last tag
        closes the thinking (Qwen3 with enable_thinking off, an assistant message continued
        after it), the grammar waits for the output to close it, as vLLM's does."""
        end = _rfind(prompt_ids, end_ids)
        return end < 0 or end < _rfind(prompt_ids, start_ids)


def _tag_prefix_at(text: str, tag: str) -> int:
    """Where a tail of ``text`` that could be the beginning of ``tag`` starts (len(text): none)."""
    for start in range(max(0, len(text) - len(tag) + 1), len(text)):
        if tag.startswith(text[start:]):
            return start
    return len(text)


def _rfind(ids: list[int], pattern: Sequence[int]) -> int:
    """Where ``pattern`` last occurs in ``ids`` (-1: nowhere)."""
    pattern = list(pattern)
    k = len(pattern)
    if not k:
        return -1
    last = pattern[-1]
    for i in range(len(ids) - 1, k - 2, -1):
        if ids[i] == last and ids[i - k + 1:i + 1] == pattern:
            return i - k + 1
    return -1


def ends_with(ids: list[int], pattern: tuple[int, ...]) -> bool:
    """Whether ``ids`` ends with ``pattern`` (the engine's check for the closing tag)."""
    k = len(pattern)
    return len(ids) >= k and tuple(ids[-k:]) == pattern


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
    "qwen3": ReasoningParser("qwen3"),
}
