"""Every environment variable Pagoda reads, in one place: its type, default and what it does.

Code reads a variable through :func:`read`, :func:`read_int` or :func:`read_flag` with its
name, when it needs it (a name missing here is a KeyError: a new variable is added to the
registry first). `pagoda env` lists them with their values; docs/environment.md has the table
(tests/test_environment.py holds the code, this registry and that table to each other).
This module imports nothing of Pagoda's, so every layer may read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    """One variable: its name, value type ("str", "int", "flag", "path"), default (as text,
    or None: unset) and what it does."""

    name: str
    kind: str
    default: str | None
    doc: str


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("PAGODA_API_KEY", "str", None,
             "the API key `pagoda serve` requires (`--api-key` wins; empty is an error, not no key)"),
    Variable("PAGODA_CACHE_DIR", "path", "~/.cache/pagoda",
             "where converted models, the compiled CPU kernels and their measurements are kept"),
    Variable("PAGODA_CPU_MARCH", "str", "native",
             "the `-march` the CPU kernels are built for (`x86-64-v3`: the AVX2 build, for testing it)"),
    Variable("PAGODA_DISABLE_CPU_KERNELS", "flag", None,
             "build and load no CPU kernel: torch's paths only"),
    Variable("PAGODA_CPU_LINEAR", "str", None,
             "the CPU linear packing instead of the measured choice: `amx`, `blocked`, `onednn` or `none` "
             "(A/B measurements)"),
    Variable("PAGODA_QUANT_TILES_MIN_ROWS", "int", None,
             "the row count from which quantized products take the AMX tiles, instead of the measured one "
             "(0: never)"),
    Variable("PAGODA_ONE_CALL_FORWARD", "flag", "1",
             "`0` runs every step layer by layer instead of in one C call (A/B measurements)"),
    Variable("PAGODA_PREFILL_TILES_MIN_TOKENS", "int", None,
             "the prefill chunk size from which attention takes the tiles, for every kind of tiles (0: never)"),
    Variable("PAGODA_CASCADE_MIN_REQUESTS", "int", None,
             "requests sharing a prefix from which a step attends to it as a cascade (0: never)"),
    Variable("PAGODA_CASCADE_MIN_TOKENS", "int", None,
             "shared tokens from which a step attends to them as a cascade"),
    Variable("PAGODA_DISABLE_PLUGIN_AUTOLOAD", "flag", None,
             "load no plugin from installed packages' entry points (built-ins and `--plugin` still load)"),
    Variable("PAGODA_WORKER_CPUS", "str", None,
             "set by the engine for each worker process it starts: the CPUs it may use (`0-3,8`)"),
    Variable("PAGODA_SIMULATED_DEVICE_MEMORY", "int", None,
             "for tests: a device of this many bytes simulated on the CPU (the KV cache sized from it)"),
    Variable("PAGODA_VLLM_PYTHON", "path", None,
             "`pagoda bench compare --peer vllm`: the python of the environment holding vLLM"),
    Variable("PAGODA_LLAMACPP_PYTHON", "path", None,
             "`pagoda bench compare --peer llamacpp`: the python of the environment holding llama-cpp-python"),
)}


def read(name: str) -> str | None:
    """The variable's value as set (empty too), or its default when it is not set."""
    default = VARIABLES[name].default  # NOTE: first: an unknown name is a KeyError even when set
    value = os.environ.get(name)
    return default if value is None else value


def cache_dir() -> Path:
    """``$PAGODA_CACHE_DIR``, or ``~/.cache/pagoda``."""
    return Path(read("PAGODA_CACHE_DIR") or VARIABLES["PAGODA_CACHE_DIR"].default).expanduser()


def read_int(name: str) -> int | None:
    """The variable as an integer, or None when unset.

    Raises:
        ValueError: It is set to something that is not an integer; the message names it.
    """
    value = read(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def read_flag(name: str) -> bool:
    """Whether the variable is set to anything but nothing, `0`, `false`, `no` or `off`."""
    value = read(name)
    return value is not None and value.strip().lower() not in ("", "0", "false", "no", "off")


def describe() -> str:
    """A table of every variable, its value here and its default (`pagoda env`)."""
    rows = [("variable", "value here", "default", "what it does")]
    for v in VARIABLES.values():
        rows.append((v.name, os.environ.get(v.name) or "-", v.default or "-", v.doc))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows)
