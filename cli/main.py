"""The `pagoda` command: `generate`, `serve` and `bench`.

The command line has a room of its own so that the engine never imports the server:
this module wires the engine's, the server's and the benchmarks' subcommands together.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from pagoda.engine.args import add_engine_args, configure_logging, engine_config_from_args


def _generate(args: argparse.Namespace) -> int:
    from pagoda.engine.frontend.llm import LLM
    from pagoda.engine.sampling_params import SamplingParams

    configure_logging(args.log_level)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.sample_seed)
    with LLM(**asdict(engine_config_from_args(args))) as llm:
        if args.raw or not llm.tokenizer.chat_template:
            outputs = llm.generate(args.prompt, params)
        else:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    for output in outputs:
        print(output.outputs[0].text)
    return 0


def _env(_args: argparse.Namespace) -> int:
    from pagoda.environment import describe

    print(describe())
    return 0


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("pagoda")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_parser(command: str | None = "bench") -> argparse.ArgumentParser:
    """The command line's parser; ``bench``'s subcommands only when ``command`` is "bench"
    (they load torch: `pagoda --help` and `pagoda serve --help` answer in well under a second)."""
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine")
    parser.add_argument("--version", action="version", version=f"pagoda {version()}")
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

    from pagoda.server.cli import add_serve_parser

    from pagoda.simulator.cli import add_simulate_parser

    add_serve_parser(sub)
    env = sub.add_parser("env", help="the environment variables Pagoda reads, with their values here")
    env.set_defaults(func=_env)
    if command == "bench":
        from pagoda.benchmarks.cli import add_bench_parser

        add_bench_parser(sub)
    else:
        sub.add_parser("bench", help="benchmarks (`pagoda bench --help` lists them)")
    add_simulate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--version"]:
        print(f"pagoda {version()}")  # NOTE: at once, without building every subcommand's parser
        return 0
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
