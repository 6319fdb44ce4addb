"""Incremental detokenization and stop-string matching for one request.

Runs in the engine process. Each step the engine feeds the request's new token ids to
:meth:`IncrementalDetokenizer.update`, which decodes only a small window of tokens (the
prefix_offset / read_offset technique of HF TGI and vLLM) instead of the whole sequence.

Streaming contract:
    * ``output_text`` is the text so far, never ending in half a UTF-8 character: text
      whose decoding ends in U+FFFD is held back until the character completes (or until
      :meth:`finish`, which flushes whatever is left). Bytes that can no longer complete
      one (a model emitting invalid UTF-8: byte tokens that never form a character) go out
      as U+FFFD once more tokens follow than a character has bytes, instead of holding the
      whole stream back until the request ends.
    * :meth:`get_delta` returns the text produced since its previous call. While the
      request runs and has stop strings, the last ``len(longest stop) - 1`` characters are
      held back, because they might be the start of a stop string; so a stop string that
      is left out of the output never appears in any delta.
    * When the request ends (stop string matched, or the engine calls :meth:`finish` for
      any other reason), everything left is released by the final :meth:`finish` /
      :meth:`get_delta`. Concatenating all deltas gives exactly ``output_text``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pagoda.engine.sampling_params import SamplingParams

# NOTE: the last few prompt tokens give the first output tokens their decoding context
# (e.g. SentencePiece's leading-space handling); 5 is vLLM's choice.
_PROMPT_CONTEXT = 5
_REPLACEMENT_CHAR = "\ufffd"
# NOTE: a UTF-8 character has at most 4 bytes and a token at least one, so a character still
# incomplete after this many tokens began in the last ones: the text before them is final.
_UTF8_MAX_BYTES = 4


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, step by step.

    Args:
        tokenizer: A transformers (fast) tokenizer.
        prompt_token_ids: The prompt; only its last few tokens are kept, as context.
        params: The request's sampling parameters (``stop``, ``skip_special_tokens``,
            ``include_stop_str_in_output`` are read).

    Attributes:
        output_text: Detokenized output so far (complete characters only), truncated at
            a matched stop string.
        stop_reason: The stop string that matched, or None.
    """

    __slots__ = (
        "_tokenizer", "_params", "_ids", "_prefix_offset", "_read_offset", "_prefix_text",
        "_max_stop_len", "_num_sent", "_finished", "output_text", "stop_reason",
    )

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._params = params
        # NOTE: _ids holds the decode window's source: ids before _prefix_offset are
        # dropped as offsets advance, so memory stays bounded by the window.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self._num_sent = 0
        self._finished = False
        self.output_text = ""
        self.stop_reason: str | None = None

    @property
    def finished(self) -> bool:
        """True once a stop string matched or :meth:`finish` was called."""
        return self._finished

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> bool:
        """Appends new tokens, extends ``output_text`` and checks the stop strings.

        Args:
            new_token_ids: Tokens sampled since the previous call (usually one).
            stop_terminated: The last of ``new_token_ids`` is EOS or a stop token id that
                ends the request; it is left out of the text unless
                ``include_stop_str_in_output``. The caller still calls :meth:`finish`.

        Returns:
            True if a stop string matched: ``output_text`` is then truncated at the match
            (keeping the stop string if ``include_stop_str_in_output``), ``stop_reason``
            is set and the detokenizer is finished. If several stop strings match, the
            one starting first wins (ties: the first listed). Calls after finishing are
            ignored and return False.
        """
        if self._finished:
            return False
        if stop_terminated and new_token_ids and not self._params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        self._ids.extend(new_token_ids)
        return self._append(self._decode_window(flush=False))

    def get_delta(self) -> str:
        """Returns the text produced since the previous call that is safe to stream.

        While running, the last ``len(longest stop) - 1`` characters are withheld if the
        request has stop strings; once finished, everything left is returned.
        """
        end = len(self.output_text)
        if not self._finished and self._max_stop_len:
            end -= self._max_stop_len - 1
        if end <= self._num_sent:
            return ""
        delta = self.output_text[self._num_sent : end]
        self._num_sent = end
        return delta

    def finish(self) -> str:
        """Ends the request: flushes held-back text and returns the final delta.

        Incomplete UTF-8 at the end is decoded as is (U+FFFD), and is still checked
        against the stop strings. Idempotent: later calls return "".
        """
        if not self._finished:
            self._append(self._decode_window(flush=True))
            self._finished = True
        return self.get_delta()

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._params.skip_special_tokens,
            # NOTE: cleanup rewrites text across window edges (" ," -> ","), which would
            # make windowed decoding disagree with the full decode.
            clean_up_tokenization_spaces=False,
        )

    def _decode_window(self, flush: bool) -> str:
        """Decodes the tokens after ``_read_offset``, advancing the offsets on success."""
        ids = self._ids
        if len(ids) == self._read_offset:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        end = len(ids)
        if new_text.endswith(_REPLACEMENT_CHAR) and not flush:
            # NOTE: half a character: keep the offsets, so the window grows until the text
            # completes, unless the text before the last few tokens is final.
            end = self._final_end(new_text)
            if end == len(ids):
                return ""
            new_text = self._decode(ids[self._prefix_offset : end])
        if len(new_text) <= len(self._prefix_text):
            return ""  # nothing yet (a skipped special token)
        delta = new_text[len(self._prefix_text) :]
        del ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, end - self._read_offset
        self._prefix_text = None
        return delta

    def _final_end(self, new_text: str) -> int:
        """Where the window's text is final though it ends in U+FFFD: with more pending tokens
        than a character has bytes, the last token boundary among the last few whose text
        before it the later tokens do not change (no character spans it: the text before it
        is the start of the whole, and a U+FFFD it ends with is followed by more characters,
        so its bytes were cut off, not waiting); else the whole window (nothing final yet)."""
        ids = self._ids
        if len(ids) - self._read_offset <= _UTF8_MAX_BYTES:
            return len(ids)
        for end in range(len(ids) - 1, len(ids) - 1 - _UTF8_MAX_BYTES, -1):
            text = self._decode(ids[self._prefix_offset : end])
            if (len(text) > len(self._prefix_text) and new_text.startswith(text)
                    and (not text.endswith(_REPLACEMENT_CHAR) or len(new_text) > len(text))):
                return end
        return len(ids)

    def _append(self, delta: str) -> bool:
        """Adds decoded text and looks for a stop string in the part that could match."""
        if not delta:
            return False
        old_len = len(self.output_text)
        self.output_text += delta
        if not self._max_stop_len:
            return False
        # NOTE: a match not wholly inside the old text (already searched) must end in the
        # delta, so it starts at most len(longest stop) - 1 chars before it.
        start = max(0, old_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._params.stop:
            i = self.output_text.find(stop, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return False
        i, stop = best
        end = i + len(stop) if self._params.include_stop_str_in_output else i
        assert end >= self._num_sent, "a delta leaked part of a stop string"
        self.output_text = self.output_text[:end]
        self.stop_reason = stop
        self._finished = True
        return True
