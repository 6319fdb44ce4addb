"""Command-line flags for EngineConfig, shared by `pagoda generate`, `serve` and `bench`."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields

from pagoda.engine.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from pagoda.engine.reasoning import REASONING_PARSERS
from pagoda.engine.sampling_params import POOLING_METHODS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds one --flag per EngineConfig field (e.g. --max-model-len, --dtype)."""
    defaults = EngineConfig()
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.name == "plugins":
            parser.add_argument("--plugin", dest="plugins", action="append", default=[], metavar="MODULE:OBJECT",
                                help="load a plugin (repeatable), after those installed under the 'pagoda' group")
        elif isinstance(default, bool) or f.type in ("bool | None", bool | None):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif f.name == "reasoning_parser":
            parser.add_argument(flag, default=default, choices=list(REASONING_PARSERS),
                                help="the model's thinking format: reasoning_content apart from content, and "
                                     "structured outputs applied after the thinking")
        elif f.name == "speculative_config":
            parser.add_argument(flag, default=None, metavar="JSON",
                                help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
        elif f.name == "kv_cache_dtype":
            parser.add_argument(flag, default=default, choices=list(KV_CACHE_DTYPES),
                                help="the KV cache's element type: auto (the model's dtype), or fp8 (= fp8_e4m3) or "
                                     "fp8_e5m2: twice the tokens in the same memory, at fp8's precision")
        elif f.name == "quantization":
            parser.add_argument(flag, default=default, choices=list(QUANTIZATIONS),
                                help="linear weights: auto (a GGUF file's own quantized types on the CPU), none "
                                     "(dequantized to --dtype), int8 (8 bits per group of 32, quantized at load)")
        elif f.name == "kv_events_config":
            parser.add_argument(flag, default=None, metavar="JSON",
                                help='KV cache events over ZMQ, vLLM\'s form, e.g. \'{"enable_kv_cache_events": true, '
                                     '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'')
        elif f.name == "lora_modules":
            parser.add_argument(flag, nargs="+", default=[], metavar="NAME=PATH",
                                help="LoRA adapters to serve from the start (with --enable-lora), as name=path or "
                                     '\'{"name": ..., "path": ...}\'; requests name one as their model')
        elif f.name == "pooling":
            parser.add_argument(flag, default=default, choices=list(POOLING_METHODS),
                                help="how /v1/embeddings pools the prompt's final hidden states (default last)")
        elif f.name == "gpu_memory_utilization":
            parser.add_argument(flag, type=float, default=default,
                                help="on a GPU, the share of its memory for the weights, activations and KV cache "
                                     "together; the KV cache gets the rest (default 0.9; unused with --kv-cache-gib)")
        elif f.name == "kv_offload_dir":
            parser.add_argument(flag, default=None, metavar="DIR",
                                help="the prefix cache's disk tier: cached KV blocks are written here and read back "
                                     "after an eviction or a restart instead of computed (docs/kv-cache.md)")
        elif isinstance(default, str) or f.name == "model":
            parser.add_argument(flag, default=default)
        else:
            parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV cache size in GiB (alternative to --kv-cache-bytes)")
    parser.add_argument("--swap-space", type=float, default=None,
                        help="CPU swap space in GiB (alternative to --swap-space-bytes)")
    parser.add_argument("--kv-offload-gib", type=float, default=None,
                        help="the disk tier's budget in GiB (alternative to --kv-offload-bytes)")
    parser.add_argument("--kv-offload-host-gib", type=float, default=None,
                        help="host memory for evicted prefix blocks, in GiB (alternative to "
                             "--kv-offload-host-bytes): before the disk tier, or alone")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="what the start-up stages and the engine log to stderr (default info)")


def configure_logging(level: str) -> None:
    """Logs to stderr with times, at ``level`` ("info", ...), for the command line."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig)}
    if args.kv_cache_gib is not None:
        values["kv_cache_bytes"] = int(args.kv_cache_gib * 1024**3)
    if args.kv_offload_gib is not None:
        values["kv_offload_bytes"] = int(args.kv_offload_gib * 1024**3)
    if args.kv_offload_host_gib is not None:
        values["kv_offload_host_bytes"] = int(args.kv_offload_host_gib * 1024**3)
    if args.swap_space is not None:
        values["swap_space_bytes"] = int(args.swap_space * 1024**3)
    return EngineConfig(**values)
