"""The `pagoda` command line: `pagoda generate` (and, with the server, `pagoda serve`)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from engine.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds one --flag per EngineConfig field (e.g. --max-model-len, --dtype)."""
    defaults = EngineConfig()
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.name == "plugins":
            parser.add_argument("--plugin", dest="plugins", action="append", default=[], metavar="MODULE:OBJECT",
                                help="load a plugin (repeatable), after those installed under the 'pagoda' group")
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, str) or f.name == "model":
            parser.add_argument(flag, default=default)
        else:
            parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV cache size in GiB (alternative to --kv-cache-bytes)")
    parser.add_argument("--swap-space", type=float, default=None,
                        help="CPU swap space in GiB (alternative to --swap-space-bytes)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig)}
    if args.kv_cache_gib is not None:
        values["kv_cache_bytes"] = int(args.kv_cache_gib * 1024**3)
    if args.swap_space is not None:
        values["swap_space_bytes"] = int(args.swap_space * 1024**3)
    return EngineConfig(**values)


def _generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.sample_seed)
    with LLM(**{f.name: getattr(engine_config_from_args(args), f.name) for f in fields(EngineConfig)}) as llm:
        if args.raw or not llm.tokenizer.chat_template:
            outputs = llm.generate(args.prompt, params)
        else:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    for output in outputs:
        print(output.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts (chat template applied unless --raw)")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    from engine.bench import add_bench_parser

    add_bench_parser(sub)
    try:
        from server.cli import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
