"""Building OpenAI response bodies and stream chunks from engine outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.messages import TokenLogprobs
from pagoda.engine.outputs import CompletionOutput
from pagoda.engine.reasoning import ReasoningParser
from pagoda.server.tool_parsers import Parsed
from pagoda.server.tools import ToolCall, ToolRequest


class TokenStrings:
    """Token id to text, cached (for logprobs): one decoded token per id.

    Args:
        tokenizer: The engine's tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._cache[token_id] = text
        return text


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def completion_logprobs(entries: list[TokenLogprobs], token_str: TokenStrings, text_offset: int,
                        num_top: int | None = None) -> dict[str, Any]:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset.

    Each ``top_logprobs`` entry holds the top tokens (at most ``num_top``) plus the token
    itself, as vLLM does; an entry without a logprob (the first prompt token's, echoed)
    has null for both.
    """
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        text = token_str(entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry.logprob is None:
            top.append(None)
            continue
        alternatives: dict[str, float] = {}
        for t, lp in zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top]):
            alternatives.setdefault(token_str(t), lp)  # NOTE: ids may share a string; the likelier one wins
        alternatives[text] = entry.logprob
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echoed_prompt_logprobs(prompt_token_ids: list[int],
                           prompt_logprobs: list[TokenLogprobs | None]) -> list[TokenLogprobs]:
    """The entries of an echoed prompt, the first token's without a logprob."""
    return [TokenLogprobs(prompt_token_ids[0], None, [], []), *prompt_logprobs[1:]]


def vllm_prompt_logprobs(prompt_logprobs: list[TokenLogprobs | None], token_str: TokenStrings,
                         num_top: int) -> list[dict[str, dict[str, Any]] | None]:
    """The ``prompt_logprobs`` field as vLLM returns it: per prompt token (null for the
    first), its own and the top ``num_top`` tokens by id, each with logprob, rank and text."""
    result: list[dict[str, dict[str, Any]] | None] = []
    for entry in prompt_logprobs:
        if entry is None:
            result.append(None)
            continue
        position = {str(t): {"logprob": lp, "rank": rank, "decoded_token": token_str(t)}
                    for rank, (t, lp) in enumerate(zip(entry.top_token_ids[:num_top],
                                                       entry.top_logprobs[:num_top]), start=1)}
        position[str(entry.token_id)] = {"logprob": entry.logprob, "rank": entry.rank,
                                         "decoded_token": token_str(entry.token_id)}
        result.append(position)
    return result


def chat_logprobs(entries: list[TokenLogprobs], token_str: TokenStrings, num_top: int) -> dict[str, Any]:
    """The chat logprobs object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for entry in entries:
        text = token_str(entry.token_id)
        top = [{"token": token_str(t), "logprob": lp, "bytes": list(token_str(t).encode())}
               for t, lp in zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top])]
        content.append({"token": text, "logprob": entry.logprob, "bytes": list(text.encode()), "top_logprobs": top})
    return {"content": content}


@dataclass(slots=True)
class SentCall:
    """A streamed tool call: its id and how much of its arguments went out."""

    id: str
    num_argument_chars: int = 0


@dataclass(slots=True)
class ChoiceState:
    """What one streamed choice has sent.

    Attributes:
        prefix: Text still to send before the output (echo).
        text_offset: Completions logprobs: offset of the next token in the choice's text.
        finished: The chunk with the finish_reason was sent.
        text: The answer so far, when it is parsed (tools, reasoning).
        num_reasoning_chars: Reasoning sent so far.
        num_content_chars: Content sent so far (parsed answers).
        calls: Tool calls sent so far.
        logprobs: Logprobs entries not yet sent (parsed answers send them with the next chunk).
        prompt_entries: Completions with echo and logprobs: the echoed prompt's entries,
            sent with the prefix.
    """

    prefix: str = ""
    text_offset: int = 0
    finished: bool = False
    text: str = ""
    num_reasoning_chars: int = 0
    num_content_chars: int = 0
    calls: list[SentCall] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_entries: list[TokenLogprobs] | None = None


class ChoiceBuilder:
    """Builds one endpoint's choices, whole or as stream deltas.

    Args:
        chat: Chat (message/delta) rather than completions (text) choices.
        num_logprobs: Top logprobs per token, None when not requested.
        token_str: Token id to text.
        tools: The chat request's tools, whose calls are parsed out of each answer.
        reasoning: The engine's reasoning parser (chat only): thinking goes to
            ``reasoning_content``.
    """

    def __init__(self, chat: bool, num_logprobs: int | None, token_str: TokenStrings,
                 tools: ToolRequest | None = None, reasoning: ReasoningParser | None = None) -> None:
        self.chat = chat
        self.num_logprobs = num_logprobs
        self.token_str = token_str
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.reasoning = reasoning if chat else None
        self.parses = self.tools is not None or self.reasoning is not None

    def _logprobs(self, entries: list[TokenLogprobs] | None, text_offset: int,
                  prompt: list[TokenLogprobs] | None = None) -> dict[str, Any] | None:
        """The choice's logprobs object (completions: an echoed prompt's entries first,
        from offset 0, then the output's from ``text_offset``)."""
        if self.num_logprobs is None or entries is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.token_str, self.num_logprobs)
        result = completion_logprobs(entries, self.token_str, text_offset, self.num_logprobs)
        if prompt:
            echoed = completion_logprobs(prompt, self.token_str, 0, self.num_logprobs)
            result = {key: echoed[key] + result[key] for key in result}
        return result

    @property
    def watches_repeats(self) -> bool:
        """The answer may make several calls: one that repeats an earlier call ends it."""
        return self.tools is not None and self.tools.parallel and self.tools.choice in ("required", "auto")

    def repeats(self, text: str) -> bool:
        """The answer so far has repeated a call (see ToolRequest.repeats)."""
        if self.reasoning is not None:
            text = self.reasoning.split(text, False)[1]
        return self.tools.repeats(text)

    def _parse(self, text: str, finished: bool, finish_reason: str | None) -> tuple[str | None, Parsed]:
        """(reasoning, content and tool calls) of an answer so far.

        An answer cut by max_tokens keeps the calls it was writing, as far as they got (a
        call whose name is written is a call, its arguments possibly unfinished JSON; a
        forced choice's answer cut before a name has no call and no content):
        parsed as a stream parses a text still growing, so that the stream and the whole
        answer hold the same calls.
        """
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text, finished)
        if self.tools is None:
            return reasoning, Parsed(text)
        if finished and finish_reason == "length":
            parsed = self.tools.parse(text, final=False)
            parsed.calls = [call for call in parsed.calls if call.name is not None]
            if parsed.calls or self.tools.choice != "auto":  # a forced answer is never content
                return reasoning, parsed
        return reasoning, self.tools.parse(text, finished)

    def whole(self, index: int, output: CompletionOutput, prefix: str = "",
              prompt_entries: list[TokenLogprobs] | None = None) -> dict[str, Any]:
        """A non-streamed choice (``prompt_entries``: an echoed prompt's logprobs)."""
        text = prefix + output.text
        logprobs = self._logprobs(output.logprobs, len(prefix), prompt_entries)
        choice: dict[str, Any] = {"index": index}
        finish = output.finish_reason
        if not self.chat:
            choice["text"] = text
        elif not self.parses:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            # NOTE: an echoed prefix is the client's own text: content, never parsed.
            reasoning, parsed = self._parse(output.text, True, finish)
            parsed.content = prefix + parsed.content
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
                message["content"] = parsed.content or None
            if parsed.calls:
                message["content"] = parsed.content or None
                message["tool_calls"] = [ToolCall(call.name, call.arguments).to_dict() for call in parsed.calls]
                finish = "tool_calls" if finish == "stop" else finish
            choice["message"] = message
        choice.update(logprobs=logprobs, finish_reason=finish, stop_reason=output.stop_reason)
        return choice

    def role(self, index: int) -> dict[str, Any]:
        """A chat stream's first chunk for a choice: the role."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def deltas(self, index: int, output: CompletionOutput, state: ChoiceState) -> list[dict[str, Any]]:
        """The stream chunks of a choice for one engine delta (``output`` holds only what is
        new): usually one, none when there is nothing new to send.

        A parsed answer (tools, reasoning) is parsed again as it grows, and what it holds
        beyond what was sent goes out: reasoning and content as text deltas, each tool
        call as OpenAI streams them (a chunk with its id and name, then pieces of its
        arguments). Text that may still turn out to be a tag waits for the next tokens.
        """
        if not self.parses:
            choice = self.delta(index, output, state)
            return [] if choice is None else [choice]
        if state.finished:
            return []
        state.text += output.text
        if self.num_logprobs is not None and output.logprobs:
            state.logprobs.extend(output.logprobs)
        reasoning, parsed = self._parse(state.text, output.finished, output.finish_reason)
        deltas: list[dict[str, Any]] = []
        if state.prefix:  # echo: the client's own text goes first, as content, unparsed
            deltas.append({"content": state.prefix})
            state.prefix = ""
        if reasoning is not None and len(reasoning) > state.num_reasoning_chars:
            deltas.append({"reasoning_content": reasoning[state.num_reasoning_chars:]})
            state.num_reasoning_chars = len(reasoning)
        content = parsed.content
        # NOTE: a final answer whose calls turn out malformed is all content; calls already
        # streamed stand, and its markup is not sent again as content.
        if len(content) > state.num_content_chars and not (state.calls and not parsed.calls):
            deltas.append({"content": content[state.num_content_chars:]})
            state.num_content_chars = len(content)
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break  # its name is still being written
            if i == len(state.calls):
                sent = ToolCall(call.name, "")
                state.calls.append(SentCall(sent.id))
                deltas.append({"tool_calls": [{"index": i, "id": sent.id, "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            sent_call = state.calls[i]
            if len(call.arguments) > sent_call.num_argument_chars:
                deltas.append({"tool_calls": [{"index": i, "function": {
                    "arguments": call.arguments[sent_call.num_argument_chars:]}}]})
                sent_call.num_argument_chars = len(call.arguments)
        chunks = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas]
        if chunks and state.logprobs:
            chunks[0]["logprobs"] = self._logprobs(state.logprobs, 0)
            state.logprobs = []
        if output.finished:
            state.finished = True
            finish = output.finish_reason
            if state.calls and finish == "stop":
                finish = "tool_calls"
            chunks.append({"index": index, "delta": {}, "finish_reason": finish, "stop_reason": output.stop_reason,
                           "logprobs": self._logprobs(state.logprobs, 0) if state.logprobs else None})
        return chunks

    def delta(self, index: int, output: CompletionOutput, state: ChoiceState) -> dict[str, Any] | None:
        """The stream chunk of a choice for one engine delta (``output`` holds only what is
        new), or None when there is nothing new to send."""
        text = output.text
        entries = output.logprobs if self.num_logprobs is not None else None
        finish = output.finish_reason if output.finished and not state.finished else None
        if not text and not entries and finish is None and not state.prefix:
            return None
        prompt = state.prompt_entries if state.prefix else None
        text = state.prefix + text
        logprobs = self._logprobs(entries or [], state.text_offset, prompt) if entries or prompt else None
        if entries:
            state.text_offset += sum(len(self.token_str(e.token_id)) for e in entries)
        state.prefix = ""
        state.finished = finish is not None
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"content": text} if text or finish is None else {}
        else:
            choice["text"] = text
        choice.update(logprobs=logprobs, finish_reason=finish)
        if finish is not None:
            choice["stop_reason"] = output.stop_reason
        return choice
