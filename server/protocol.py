"""Parsing and validating the JSON bodies of /v1/completions and /v1/chat/completions.

Fields follow OpenAI's API plus vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, min_tokens, ...). ``null`` means "the
default", as in OpenAI's API.

Unknown fields are rejected with a 400 naming the field, as OpenAI does ("Unrecognized
request argument supplied: foo"): a misspelt ``max_token`` must not silently fall back to
the default. Fields OpenAI defines that only label the request (``user``, ``metadata``,
``store``...) are accepted and ignored; fields whose effect Pagoda cannot honour
(``functions``, ``audio``...) are rejected with a 400 when set to anything but their
no-op value. ``response_format``, ``structured_outputs`` and vLLM's ``guided_*`` fields
constrain the output (docs/structured-outputs.md).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.server.config import ServerConfig
from pagoda.server.errors import bad_request, from_value_error
from pagoda.server.tool_parsers import KEEPS_SPECIAL_TOKENS
from pagoda.server.tools import ToolRequest, ToolSyntax, parse_tools

MAX_STOP_LENGTH = 256
#: Chat's max_tokens for a constrained request that sets none (the context otherwise).
STRUCTURED_MAX_TOKENS = 4096

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Sampling fields shared by both endpoints (vLLM's names and semantics).
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "skip_special_tokens",
    "include_stop_str_in_output", "max_tokens",
)
_COMMON_FIELDS = _SAMPLING_FIELDS + (
    "model", "stream", "stream_options", "user", "priority", "cache_salt", "kv_retention", "logprobs", "echo",
    "add_special_tokens", "logit_bias", "metadata", "store", "service_tier", "prompt_cache_key",
    "safety_identifier", "response_format", "prompt_logprobs", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "allowed_token_ids", "bad_words",
)
COMPLETION_FIELDS = frozenset(_COMMON_FIELDS + ("prompt", "best_of", "suffix"))
CHAT_FIELDS = frozenset(_COMMON_FIELDS + (
    "messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
    "modalities", "audio", "prediction", "web_search_options", "reasoning_effort", "verbosity",
))


@dataclass(slots=True)
class GenerateRequest:
    """A validated /v1/completions or /v1/chat/completions request.

    Attributes:
        model: The requested model name (None: the server's default).
        params: Sampling parameters for the engine.
        max_tokens: The max_tokens the client gave, None when left out (then completions
            default to 16 tokens and chat to the room left in the context; either is
            clamped to the context, while a max_tokens given that does not fit is a 400).
        max_tokens_param: The field that gave it (chat: max_completion_tokens wins).
        stream: Send SSE chunks.
        include_usage: Send a usage chunk before ``[DONE]`` (stream_options).
        continuous_usage: With include_usage, put the usage so far in every chunk
            (vLLM's ``continuous_usage_stats``).
        logprobs: Top logprobs per token to return (None: no logprobs).
        echo: Completions: prepend the prompt to the text. Chat: prepend the last
            message's content when it is the assistant's.
        add_special_tokens: Let the tokenizer add BOS etc. to a text prompt.
        priority: Scheduling priority (lower runs first) for the priority policy.
        cache_salt: Prefix-cache isolation salt.
        kv_retention: Eviction priority of the request's cached blocks (higher is kept
            longer) for the retention-priority eviction policy.
        prompts: Completions: one or more prompts, text or token ids.
        messages: Chat: the conversation, normalized to role/content(/name) dicts.
        add_generation_prompt: Chat: end the rendered prompt with the assistant header.
        continue_final_message: Chat: let the model continue the last message.
        chat_template_kwargs: Chat: extra variables for the template.
        structured_param: The field that gave ``params.structured_outputs`` (for errors).
        tools: Chat: the tools and tool_choice (None without tools).
        prompt_logprobs: Top logprobs per prompt token asked by the ``prompt_logprobs``
            field (vLLM's): returned in vLLM's shape, apart from echo's.
        score_only: Completions with ``max_tokens: 0`` and echo: the prompt (and its
            logprobs) only; the one token the engine samples is dropped.
    """

    model: str | None
    params: SamplingParams
    max_tokens: int | None
    max_tokens_param: str = "max_tokens"
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    kv_retention: int = 0
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    structured_param: str | None = None
    tools: ToolRequest | None = None
    prompt_logprobs: int | None = None
    score_only: bool = False


EMBEDDING_FIELDS = frozenset(("input", "model", "encoding_format", "dimensions", "user", "add_special_tokens",
                              "priority"))


@dataclass(slots=True)
class EmbeddingRequest:
    """A validated /v1/embeddings request.

    Attributes:
        model: The requested model name (None: the server's default).
        inputs: The texts or token-id lists to embed, in order.
        encoding_format: "float" (JSON numbers) or "base64" (little-endian float32 bytes).
        dimensions: Length asked for each vector (None: the model's hidden size).
        add_special_tokens: Let the tokenizer add BOS etc. to a text input.
        priority: Scheduling priority (lower runs first) for the priority policy.
    """

    model: str | None
    inputs: list[str | list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    add_special_tokens: bool = True
    priority: int = 0


def parse_embedding(body: Any, config: ServerConfig) -> EmbeddingRequest:
    """Validates a /v1/embeddings body.

    Raises:
        APIError: 400 naming the field at fault.
    """
    b = check_fields(body, EMBEDDING_FIELDS)
    value = body.get("input")
    if isinstance(value, list) and not value:
        raise bad_request("'input' must not be an empty list", "input")
    inputs = _parse_prompts(value, config, "input")
    encoding_format = b.str_("encoding_format", "float")
    if encoding_format not in ("float", "base64"):
        raise bad_request(f"'encoding_format' must be 'float' or 'base64', got {encoding_format!r}",
                          "encoding_format")
    b.str_("user")
    return EmbeddingRequest(model=b.str_("model"), inputs=inputs, encoding_format=encoding_format,
                            dimensions=b.int_("dimensions", None, 1),
                            add_special_tokens=b.bool_("add_special_tokens", True), priority=b.int_("priority", 0))


class Body:
    """Typed getters over a request body; ``null`` reads as the default."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def int_(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad_request(f"'{name}' must be an integer, got {value!r}", name)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None \
                else f"<= {hi}"
            raise bad_request(f"'{name}' must be {bounds}, got {value}", name)
        return value

    def number(self, name: str, default: float, low: float | None = None, high: float | None = None) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad_request(f"'{name}' must be a number, got {value!r}", name)
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = (f"in [{low:g}, {high:g}]" if low is not None and high is not None
                      else f">= {low:g}" if low is not None else f"<= {high:g}")
            raise bad_request(f"'{name}' must be {bounds}, got {value!r}", name)
        return float(value)

    def bool_(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"'{name}' must be a boolean, got {value!r}", name)
        return value

    def str_(self, name: str, default: str | None = None) -> str | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise bad_request(f"'{name}' must be a string, got {type(value).__name__}", name)
        return value

    def unsupported(self, name: str, allowed: tuple = (), what: str = "") -> None:
        """Rejects a field set to anything but null, an empty value, or an allowed no-op value."""
        value = self.body.get(name)
        if value is None or value in allowed or (isinstance(value, (list, dict, str)) and not value):
            return
        raise bad_request(f"'{name}' is not supported by this server{what}", name, code="unsupported_parameter")


def parse_completion(body: Any, config: ServerConfig) -> GenerateRequest:
    """Validates a /v1/completions body.

    Raises:
        APIError: 400 naming the field at fault.
    """
    b = check_fields(body, COMPLETION_FIELDS)
    prompts = _parse_prompts(body.get("prompt"), config)
    b.unsupported("suffix")
    logprobs = b.int_("logprobs", None, 0, config.max_logprobs)
    n = b.int_("n", 1, 1, config.max_n)
    best_of = b.int_("best_of", None)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' is not supported by this server unless it equals n", "best_of",
                          code="unsupported_parameter")
    echo = b.bool_("echo", False)
    if echo and (n > 1 or (best_of or 1) > 1):
        raise bad_request("'echo' needs n = 1 (and no best_of): the prompt and its logprobs would be repeated "
                          "in every choice", "echo")
    max_tokens = b.int_("max_tokens", None)
    score_only = max_tokens == 0
    if score_only:
        if not echo:
            raise bad_request("'max_tokens' must be >= 1 (0, scoring the prompt only, needs 'echo': true)",
                              "max_tokens")
        max_tokens = 1  # NOTE: the engine samples one token; the answer drops it
    request = _parse_common(b, config, logprobs, max_tokens, default_max_tokens=16)
    request.prompts = prompts
    request.score_only = score_only
    if echo and logprobs is not None:
        # The echoed prompt's tokens get logprobs too, computed during its prefill.
        request.params.prompt_logprobs = max(logprobs, request.params.prompt_logprobs or 0)
    return request


def parse_chat(body: Any, config: ServerConfig, tool_syntax: ToolSyntax | None = None) -> GenerateRequest:
    """Validates a /v1/chat/completions body (``tool_syntax``: how the model writes calls).

    Raises:
        APIError: 400 naming the field at fault.
    """
    b = check_fields(body, CHAT_FIELDS)
    messages = parse_messages(body.get("messages"))
    for name in ("functions", "audio", "prediction", "web_search_options"):
        b.unsupported(name, what=" (Pagoda has no legacy function calling ('tools' it has), audio or web search)")
    b.unsupported("function_call", ("none", "auto"))
    tools = parse_tools(body, tool_syntax)
    b.unsupported("modalities", (["text"],))
    logprobs = None
    if b.bool_("logprobs", False):
        logprobs = b.int_("top_logprobs", 0, 0, config.max_logprobs)
    elif body.get("top_logprobs") not in (None, 0):
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    max_tokens = b.int_("max_completion_tokens", None)
    max_tokens_param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_param = b.int_("max_tokens", None), "max_tokens"
    request = _parse_common(b, config, logprobs, max_tokens, add_special_tokens=False,
                            max_tokens_param=max_tokens_param)
    request.messages = messages
    request.add_generation_prompt = b.bool_("add_generation_prompt", True)
    request.continue_final_message = b.bool_("continue_final_message", False)
    if request.add_generation_prompt and request.continue_final_message:
        raise bad_request("'continue_final_message' needs 'add_generation_prompt' to be false",
                          "continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    request.chat_template_kwargs = kwargs or {}
    request.tools = tools
    if tools is not None and tools.parser in KEEPS_SPECIAL_TOKENS and "skip_special_tokens" not in body:
        request.params.skip_special_tokens = False  # its calls start with a special token
    if tools is not None and tools.choice != "none":
        answer = request.params.structured_outputs
        if answer is not None and tools.choice != "auto":
            raise bad_request(f"'tool_choice' {tools.choice!r} constrains the output; it cannot be combined with "
                              f"'{request.structured_param}'", "tool_choice", code="invalid_structured_outputs")
        constraint = tools.constraint(answer)
        if constraint is not answer:
            request.params.structured_outputs, request.structured_param = constraint, "tools"
    if request.params.structured_outputs is not None and max_tokens is None:
        # NOTE: chat's default is the whole context; an open-ended constraint (json_object,
        # "(ab)+") could run to it. Answers past this are rare; a client may ask for more.
        limit = request.params.max_tokens
        request.params.max_tokens = STRUCTURED_MAX_TOKENS if limit is None else min(limit, STRUCTURED_MAX_TOKENS)
    return request


def check_fields(body: Any, known: frozenset[str]) -> Body:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    for name in body:
        if name not in known:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name,
                              code="unrecognized_argument")
    return Body(body)


def _parse_common(b: Body, config: ServerConfig, logprobs: int | None, max_tokens: int | None,
                  add_special_tokens: bool = True, default_max_tokens: int | None = None,
                  max_tokens_param: str = "max_tokens") -> GenerateRequest:
    model = b.str_("model")
    limit = config.max_tokens_limit
    if limit is not None:
        if max_tokens is not None and max_tokens > limit:
            raise bad_request(f"'{max_tokens_param}' is too large: {max_tokens}. This server generates at most "
                              f"{limit} tokens per request (--max-tokens-limit).", max_tokens_param,
                              code="max_tokens_limit_exceeded")
        if default_max_tokens is None or default_max_tokens > limit:
            default_max_tokens = limit
    stream = b.bool_("stream", False)
    options = b.get("stream_options")
    include_usage = continuous_usage = False
    if options is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        # NOTE: other keys are ignored, as OpenAI's API does (it adds options over time).
        include_usage = Body(options).bool_("include_usage", False)
        continuous_usage = Body(options).bool_("continuous_usage_stats", False)
    logit_bias = b.get("logit_bias")
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise bad_request("'logit_bias' must map token ids (as strings) to numbers in [-100, 100]", "logit_bias")
    for name in ("allowed_token_ids", "bad_words"):
        if b.get(name) is not None and not isinstance(b.get(name), list):
            raise bad_request(f"'{name}' must be a list", name)
    prompt_logprobs = b.int_("prompt_logprobs", None, 0, config.max_logprobs)
    if prompt_logprobs is not None and stream:
        raise bad_request("'prompt_logprobs' is not available when 'stream' is true (with 'echo' and 'logprobs', "
                          "completions stream the prompt's logprobs in the first chunk)", "prompt_logprobs")
    structured, structured_param = _parse_structured(b)
    stop = _parse_stop(b.get("stop"), config)
    stop_token_ids = b.get("stop_token_ids")
    if stop_token_ids is not None and (not isinstance(stop_token_ids, list)
                                       or not all(isinstance(t, int) and not isinstance(t, bool)
                                                  for t in stop_token_ids)):
        raise bad_request("'stop_token_ids' must be a list of integers", "stop_token_ids")
    echo = b.bool_("echo", False)
    priority = b.int_("priority", 0)
    kv_retention = b.int_("kv_retention", 0)
    cache_salt = b.str_("cache_salt")
    if cache_salt is not None and not cache_salt:
        raise bad_request("'cache_salt' must not be empty", "cache_salt")
    for name in ("user", "service_tier", "prompt_cache_key", "safety_identifier", "reasoning_effort",
                 "verbosity"):
        b.str_(name)
    for name in ("store", "parallel_tool_calls"):
        b.bool_(name, False)
    try:
        params = SamplingParams(
            n=b.int_("n", 1, 1, config.max_n),
            temperature=b.number("temperature", 1.0, 0, 2),  # NOTE: OpenAI's bounds
            top_p=b.number("top_p", 1.0),
            top_k=b.int_("top_k", 0),
            min_p=b.number("min_p", 0.0),
            seed=b.int_("seed", None),
            repetition_penalty=b.number("repetition_penalty", 1.0),
            presence_penalty=b.number("presence_penalty", 0.0),
            frequency_penalty=b.number("frequency_penalty", 0.0),
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            min_tokens=b.int_("min_tokens", 0),
            stop=stop,
            stop_token_ids=stop_token_ids or [],
            ignore_eos=b.bool_("ignore_eos", False),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=b.bool_("skip_special_tokens", True),
            include_stop_str_in_output=b.bool_("include_stop_str_in_output", False),
            structured_outputs=structured,
            logit_bias=logit_bias or None,
            allowed_token_ids=b.get("allowed_token_ids"),
            bad_words=b.get("bad_words"),
        )
    except ValueError as exc:
        error = from_value_error(exc)
        if error.param == "max_tokens":
            error.param = max_tokens_param  # NOTE: the field the client sent
        raise error from None
    return GenerateRequest(
        model=model, params=params, max_tokens=max_tokens, max_tokens_param=max_tokens_param, stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage, logprobs=logprobs, echo=echo,
        add_special_tokens=b.bool_("add_special_tokens", add_special_tokens), priority=priority,
        cache_salt=cache_salt, kv_retention=kv_retention, structured_param=structured_param,
        prompt_logprobs=prompt_logprobs,
    )


_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "structural_tag", "json_object")
# vLLM's older fields, each one kind of structured_outputs.
_GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                   "guided_grammar": "grammar"}


def _parse_structured(b: Body) -> tuple[StructuredOutputsParams | None, str | None]:
    """The output constraint from response_format, structured_outputs or a guided_* field
    (at most one of them), and the field it came from."""
    given = [name for name in ("response_format", "structured_outputs", *_GUIDED_ALIASES)
             if b.get(name) is not None and b.get(name) != {"type": "text"}]
    if not given:
        return None, None
    if len(given) > 1:
        raise bad_request(f"only one of {', '.join(given)} may be given", given[1], code="invalid_structured_outputs")
    name = given[0]
    value = b.get(name)
    try:
        if name in _GUIDED_ALIASES:
            return StructuredOutputsParams(**{_GUIDED_ALIASES[name]: value}), name
        if name == "structured_outputs":
            if not isinstance(value, dict):
                raise ValueError("structured_outputs must be an object")
            unknown = [key for key in value if key not in _STRUCTURED_KEYS]
            if unknown:
                raise ValueError(f"structured_outputs: unknown field {unknown[0]!r} (known: {', '.join(_STRUCTURED_KEYS)})")
            return StructuredOutputsParams(**{k: v for k, v in value.items() if v is not None}), name
        if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                             "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        if value["type"] == "json_object":
            return StructuredOutputsParams(json_object=True), name
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema' object")
        return StructuredOutputsParams(json=spec["schema"]), name
    except (ValueError, TypeError) as exc:
        message = str(exc).removeprefix("structured_outputs ").removeprefix("structured_outputs: ")
        raise bad_request(f"{name}: {message}", name, code="invalid_structured_outputs") from None


def _parse_stop(stop: Any, config: ServerConfig) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > config.max_stop:
        raise bad_request(f"'stop' has {len(stop)} strings; at most {config.max_stop} are allowed", "stop")
    if any(len(s) > MAX_STOP_LENGTH for s in stop):
        raise bad_request(f"each 'stop' string must be at most {MAX_STOP_LENGTH} characters long", "stop")
    return stop


def _parse_prompts(prompt: Any, config: ServerConfig, name: str = "prompt") -> list[str | list[int]]:
    """Completions' ``prompt`` (or embeddings' ``input``): one or more texts or token-id lists."""
    def is_ids(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)

    if prompt is None:
        raise bad_request(f"'{name}' is required", name)
    if isinstance(prompt, str):
        prompts = [prompt]
    elif is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request(f"'{name}' must be a string, a list of strings, a list of token ids, or a list of "
                          "lists of token ids (none empty)", name)
    if any(p == "" for p in prompts):
        raise bad_request(f"'{name}' must not be empty", name)
    if len(prompts) > config.max_prompts:
        raise bad_request(f"'{name}' has {len(prompts)} inputs; at most {config.max_prompts} are allowed", name)
    return prompts


def parse_messages(messages: Any) -> list[dict[str, str]]:
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}; got {role!r}", f"{where}.role")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"'{where}.content' parts must be {{\"type\": \"text\", \"text\": ...}}; "
                                      "this server handles text only", f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role in ("assistant", "tool"):
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"'{where}.content' must be a string or a list of text parts", f"{where}.content")
        normalized = {"role": "system" if role == "developer" else role, "content": content}
        if isinstance(message.get("name"), str):
            normalized["name"] = message["name"]
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            normalized["tool_call_id"] = message["tool_call_id"]
        if role == "assistant" and message.get("tool_calls"):
            normalized["tool_calls"] = _parse_tool_calls(message["tool_calls"], where)
        result.append(normalized)
    return result


def _parse_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, for the chat template: arguments as an object
    (templates render them with tojson), as transformers' tool-use templates expect."""
    if not isinstance(calls, list):
        raise bad_request(f"'{where}.tool_calls' must be a list", f"{where}.tool_calls")
    result = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"'{where}.tool_calls[{j}]' must have a function with a name", f"{where}.tool_calls")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            # NOTE: a call cut by max_tokens has arguments that are not (yet) JSON; the
            # server sent it so, and takes it back as the text it is.
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments or "{}")
        result.append({"id": call.get("id"), "type": "function",
                       "function": {"name": function["name"], "arguments": arguments}})
    return result
