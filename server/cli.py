"""``pagoda serve``: the OpenAI-compatible server's command line.

``cli/main.py`` calls :func:`add_serve_parser` on its subcommands. Every engine flag of
``pagoda generate`` is accepted too (``--max-model-len``, ``--dtype``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from pagoda.environment import read
from pagoda.engine.args import add_engine_args, configure_logging, engine_config_from_args
from pagoda.engine.sampling_params import MAX_LOGPROBS, MAX_N
from pagoda.server.config import DEFAULT_MAX_BODY_BYTES, ServerConfig
from pagoda.server.tool_parsers import TOOL_CALL_PARSERS

API_KEY_ENV = "PAGODA_API_KEY"


def _add(parser: argparse.ArgumentParser, flag: str, **kwargs) -> None:
    # NOTE: an engine flag of the same name wins, so a new EngineConfig field never
    # breaks the command line.
    if flag not in parser._option_string_actions:
        parser.add_argument(flag, **kwargs)


def _optional_int(value: str) -> int | None:
    """An integer flag where 0 means "no limit"."""
    number = int(value)
    return None if number == 0 else number


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``serve`` subcommand."""
    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (see docs/server.md).",
    )
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve (same as --model); default: SmolLM2-135M-Instruct")
    add_engine_args(parser)
    _add(parser, "--host", default="127.0.0.1",
         help="interface to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    _add(parser, "--port", type=int, default=8000, help="TCP port (default 8000)")
    _add(parser, "--api-key", default=None,
         help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (default: ${API_KEY_ENV})")
    _add(parser, "--served-model-name", nargs="+", default=[], metavar="NAME",
         help="names the model answers to (default: the --model value)")
    _add(parser, "--max-waiting-requests", type=int, default=None,
         help="answer 503 with Retry-After while this many requests wait (default: no limit)")
    _add(parser, "--max-concurrent-requests", type=_optional_int, default=1024,
         help="generation requests in flight at once; more get 429 (default 1024; 0 for no limit)")
    _add(parser, "--max-concurrent-requests-per-key", type=_optional_int, default=None,
         help="the same per API key, or per client address without keys; more get 429 (default: no limit)")
    _add(parser, "--max-sequences-per-request", type=_optional_int, default=None,
         help="most sequences (prompts x n) in one request; more get 400 (default: half of --max-num-seqs)")
    _add(parser, "--max-tokens-per-request", type=_optional_int, default=None,
         help="most tokens (each sequence's prompt + max_tokens) in one request; more get 400 "
              "(default: 4 x the KV cache's tokens)")
    _add(parser, "--max-sequences-per-client", type=_optional_int, default=None,
         help="most sequences one client (API key, --client-header, or address) has in flight; more get 429 "
              "(default: 2 x --max-num-seqs)")
    _add(parser, "--max-tokens-per-client", type=_optional_int, default=None,
         help="most tokens one client has in flight; more get 429 (default: 8 x the KV cache's tokens)")
    _add(parser, "--max-tokens-limit", type=_optional_int, default=None,
         help="most tokens one request may generate; larger max_tokens get 400 (default: the context)")
    _add(parser, "--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
         help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_BODY_BYTES})")
    _add(parser, "--shutdown-timeout", type=float, default=30.0,
         help="seconds in-flight requests get to finish on SIGTERM/SIGINT (default 30)")
    _add(parser, "--max-n", type=int, default=MAX_N, help=f"largest n (default {MAX_N})")
    _add(parser, "--max-logprobs", type=int, default=MAX_LOGPROBS,
         help=f"largest logprobs / top_logprobs (default {MAX_LOGPROBS})")
    _add(parser, "--max-stop", type=int, default=16, help="most stop strings per request (default 16)")
    _add(parser, "--max-prompts", type=int, default=2048,
         help="most prompts in one /v1/completions request (default 2048)")
    _add(parser, "--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    _add(parser, "--otlp-traces-endpoint", default=None,
         help="export OpenTelemetry traces to this OTLP endpoint (needs opentelemetry-exporter-otlp)")
    _add(parser, "--enable-auto-tool-choice", action="store_true",
         help='accepted for vLLM\'s command lines: tool_choice "auto" works without it')
    _add(parser, "--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
         help="how tool calls are found in the model's text for tool_choice auto (default: read from the chat "
              "template, else hermes): hermes (<tool_call> JSON; Qwen2.5, Hermes), llama3_json (Llama 3.1-3.3), "
              "mistral ([TOOL_CALLS]), pythonic ([f(x=1)])")
    _add(parser, "--client-header", default=None, metavar="NAME",
         help="a request header that names the client, for --scheduling-policy fair and the per-key limits "
              "(default: the API key, else the client's address)")
    _add(parser, "--allowed-origins", type=_json_list, default=[],
         help='origins browsers may call the API from, as a JSON list, e.g. \'["https://app.example"]\' or '
              '\'["*"]\' (default []: CORS off, so no web page can read the answers)')
    _add(parser, "--allowed-methods", type=_json_list, default=["GET", "POST", "OPTIONS"],
         help='methods a CORS preflight allows, as a JSON list (default ["GET", "POST", "OPTIONS"])')
    _add(parser, "--allowed-headers", type=_json_list, default=["*"],
         help='request headers a CORS preflight allows, as a JSON list (default ["*"])')
    _add(parser, "--allow-credentials", action="store_true", help="let browsers send credentials (CORS)")
    _add(parser, "--header-timeout", type=float, default=15.0,
         help="seconds a connection may take to send a request's headers, or stay idle between requests (default 15)")
    _add(parser, "--body-timeout", type=float, default=60.0,
         help="seconds a request body may take to arrive; then 408 (default 60)")
    _add(parser, "--max-connections", type=_optional_int, default=2048,
         help="open connections; past it new ones get 503 and are closed (default 2048; 0: no limit)")
    _add(parser, "--keep-alive-on-engine-death", action="store_true",
         help="past the worker restart budget, keep answering 503 instead of exiting with status 1 (the "
              "default, so that systemd or Kubernetes restarts the server)")
    _add(parser, "--responses-store-size", type=int, default=1024,
         help="responses (/v1/responses) kept in memory for previous_response_id and GET, newest first "
              "(default 1024; 0 keeps none)")
    _add(parser, "--console", action=argparse.BooleanOptionalAction, default=True,
         help="the live console at /console and the engine's state at /v1/engine/state (--no-console: off)")
    _add(parser, "--access-log", action=argparse.BooleanOptionalAction, default=True,
         help="log one line per HTTP request")
    parser.set_defaults(func=serve)
    return parser


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host, port=args.port, api_key=_api_key(args.api_key),
        served_model_names=list(args.served_model_name), max_waiting_requests=args.max_waiting_requests,
        max_concurrent_requests=args.max_concurrent_requests,
        max_concurrent_requests_per_key=args.max_concurrent_requests_per_key,
        max_tokens_limit=args.max_tokens_limit,
        max_body_bytes=args.max_request_body_bytes, shutdown_timeout=args.shutdown_timeout, max_n=args.max_n,
        max_logprobs=args.max_logprobs, max_stop=args.max_stop, max_prompts=args.max_prompts,
        chat_template=args.chat_template, otlp_traces_endpoint=args.otlp_traces_endpoint,
        access_log=args.access_log,
        tool_call_parser=args.tool_call_parser, client_header=args.client_header,
        max_sequences_per_request=args.max_sequences_per_request, max_tokens_per_request=args.max_tokens_per_request,
        max_sequences_per_client=args.max_sequences_per_client, max_tokens_per_client=args.max_tokens_per_client,
        responses_store_size=args.responses_store_size, console=args.console,
        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
        keep_alive_on_engine_death=args.keep_alive_on_engine_death, header_timeout=args.header_timeout,
        body_timeout=args.body_timeout, max_connections=args.max_connections,
    )


def _json_list(value: str) -> list[str]:
    try:
        items = json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a JSON list: {value!r}") from None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {value!r}")
    return items


def _api_key(flag: str | None) -> str | None:
    """--api-key, else PAGODA_API_KEY; an empty one is an error, not a server without a key."""
    key, source = (flag, "--api-key") if flag is not None else (read(API_KEY_ENV), API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"{source} is empty: give a key, or leave it out to serve without one")
    return key


def serve(args: argparse.Namespace) -> int:
    """Runs ``pagoda serve``; returns the exit status."""
    from pagoda.server.app import run_server

    configure_logging(args.log_level)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    engine_config = engine_config_from_args(args)
    if engine_config.standby_worker is None:  # auto: a server keeps a standby worker for restarts
        engine_config = dataclasses.replace(engine_config, standby_worker=True)
    config = server_config_from_args(args)
    try:
        return run_server(engine_config, config)
    except Exception as exc:  # noqa: BLE001 - startup failures (bad model, port in use) end the command
        logging.getLogger("server").debug("server failed", exc_info=True)
        print(f"error: {exc}", file=sys.stderr)
        return 1
