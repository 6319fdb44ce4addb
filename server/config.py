"""ServerConfig: every knob of the HTTP server, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.engine.sampling_params import MAX_LOGPROBS, MAX_N

DEFAULT_MAX_BODY_BYTES = 8 * 1024**2


@dataclass(slots=True)
class ServerConfig:
    """Configuration of the OpenAI-compatible server (the engine has its own).

    Attributes:
        host: Interface to listen on.
        port: TCP port.
        api_key: When set, every endpoint but /health requires ``Authorization: Bearer <key>``.
        served_model_names: Names the model answers to; the first is the one /v1/models
            lists first and the default for requests that leave ``model`` out. Empty means
            the ``--model`` value (or the default model's name).
        max_waiting_requests: Turn requests away with 503 while this many wait to be
            scheduled; None means no limit.
        max_concurrent_requests: Generation requests in flight at once (streaming or
            not); one more gets 429. None means no limit.
        max_concurrent_requests_per_key: The same, per client: per API key when the
            request has one, else per client address. None means no limit.
        max_tokens_limit: The most tokens one request may ask to generate (max_tokens,
            max_completion_tokens); more is a 400, and requests that leave it out are
            capped to it. None means up to the context.
        max_body_bytes: Largest request body; larger ones get 413.
        shutdown_timeout: Seconds that in-flight requests get to finish on SIGTERM/SIGINT.
        max_n: Largest ``n``.
        max_logprobs: Largest ``logprobs`` (completions) / ``top_logprobs`` (chat).
        max_stop: Most stop strings in one request.
        max_prompts: Most prompts in one /v1/completions request.
        chat_template: A Jinja chat template (text, or a path to a file) overriding the
            tokenizer's.
        otlp_traces_endpoint: Export traces to this OTLP endpoint (turns tracing on).
        access_log: Log one line per HTTP request.
        tool_call_parser: How calls are found in a model's own text for "auto" (hermes,
            llama3_json, mistral, pythonic: server/tool_parsers.py); None: chosen from the
            chat template (server/tools.py, choose_tool_syntax).
        max_sequences_per_request: Prompts x n of one request; None: half the engine's
            max_num_seqs (server/limits.py).
        max_tokens_per_request: Sum over a request's sequences of prompt + max_tokens;
            None: four times the KV cache's tokens.
        max_sequences_per_client: Sequences one client may have in flight; None: twice
            max_num_seqs.
        max_tokens_per_client: Tokens (as above) one client may have in flight; None:
            eight times the KV cache's tokens.
        allowed_origins: Origins browsers may call the API from (CORS); ``["*"]`` any,
            ``[]`` (the default) none: no CORS headers, so no web page can read the answers.
        allowed_methods: Methods a preflight allows.
        allowed_headers: Request headers a preflight allows (``*``: whatever it asks for).
        allow_credentials: Let browsers send cookies and credentials.
        keep_alive_on_engine_death: Keep serving 503s after the engine stops for good
            instead of exiting with status 1 (``pagoda serve``).
        header_timeout: Seconds a connection may take to send a whole request's headers,
            and stay idle between requests (aiohttp's keep-alive timeout); then it is closed.
        body_timeout: Seconds a request's body may take to arrive (408 after).
        max_connections: Open connections; past it new ones get a 503 and are closed.
        client_header: A request header that names the client (for the fair policy and
            the per-key limits), e.g. one a gateway sets; None: the API key, else the
            client's address.
        console: Serve the live console at /console and the engine's state at /v1/engine/state.
        responses_store_size: Responses (/v1/responses) kept in memory for
            ``previous_response_id`` and retrieval, the newest first; 0 keeps none.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: list[str] = field(default_factory=list)
    max_waiting_requests: int | None = None
    max_concurrent_requests: int | None = 1024
    max_concurrent_requests_per_key: int | None = None
    max_tokens_limit: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout: float = 30.0
    max_n: int = MAX_N
    max_logprobs: int = MAX_LOGPROBS
    max_stop: int = 16
    max_prompts: int = 2048
    chat_template: str | None = None
    otlp_traces_endpoint: str | None = None
    access_log: bool = True
    tool_call_parser: str | None = None
    client_header: str | None = None
    keep_alive_on_engine_death: bool = False
    header_timeout: float = 15.0
    body_timeout: float = 60.0
    max_connections: int | None = 2048
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["GET", "POST", "OPTIONS"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    max_sequences_per_request: int | None = None
    max_tokens_per_request: int | None = None
    max_sequences_per_client: int | None = None
    max_tokens_per_client: int | None = None
    responses_store_size: int = 1024
    console: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535]; got {self.port!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it out to serve without a key)")
        for name in ("max_body_bytes", "max_n", "max_stop", "max_prompts"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        for name in ("max_concurrent_requests", "max_concurrent_requests_per_key", "max_tokens_limit",
                     "max_sequences_per_request", "max_tokens_per_request", "max_sequences_per_client",
                     "max_tokens_per_client", "max_connections"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None; got {value!r}")
        if not isinstance(self.responses_store_size, int) or self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be a non-negative integer; got {self.responses_store_size!r}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0; got {self.max_waiting_requests!r}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}]; got {self.max_logprobs!r}")
        if self.max_n > MAX_N:
            raise ValueError(f"max_n must be <= {MAX_N}; got {self.max_n!r}")
        if not self.header_timeout > 0 or not self.body_timeout > 0:
            raise ValueError(f"header_timeout and body_timeout must be positive; got {self.header_timeout!r}, "
                             f"{self.body_timeout!r}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0; got {self.shutdown_timeout!r}")
