"""The environment variables: every one the code reads is in the registry (environment.py) and
in docs/environment.md's table, and the registry's readers say what they read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagoda import environment
from pagoda.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
CODE_FOLDERS = ("engine", "plugins", "attention_backends", "native", "server", "cli", "benchmarks", "simulator")


def names_in(text: str) -> set[str]:
    return set(re.findall(r"\bPAGODA_[A-Z0-9_]+\b", text))


def test_every_variable_the_code_names_is_registered_and_documented():
    in_code = set()
    for folder in CODE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            in_code |= names_in(path.read_text())
    registered = set(environment.VARIABLES)
    assert in_code - registered == set(), "read but not in environment.py"
    assert registered - in_code == set(), "registered but read nowhere"
    table = (ROOT / "docs" / "environment.md").read_text()
    assert registered - names_in(table) == set(), "not in docs/environment.md"


def test_the_readers_parse_and_name_the_variable(monkeypatch):
    monkeypatch.delenv("PAGODA_QUANT_TILES_MIN_ROWS", raising=False)
    assert environment.read_int("PAGODA_QUANT_TILES_MIN_ROWS") is None
    monkeypatch.setenv("PAGODA_QUANT_TILES_MIN_ROWS", "32")
    assert environment.read_int("PAGODA_QUANT_TILES_MIN_ROWS") == 32
    monkeypatch.setenv("PAGODA_QUANT_TILES_MIN_ROWS", "many")
    with pytest.raises(ValueError, match="PAGODA_QUANT_TILES_MIN_ROWS must be an integer"):
        environment.read_int("PAGODA_QUANT_TILES_MIN_ROWS")
    monkeypatch.delenv("PAGODA_ONE_CALL_FORWARD", raising=False)
    assert environment.read_flag("PAGODA_ONE_CALL_FORWARD")  # its default is on
    for off in ("0", "false", "off", ""):
        monkeypatch.setenv("PAGODA_ONE_CALL_FORWARD", off)
        assert not environment.read_flag("PAGODA_ONE_CALL_FORWARD")
    monkeypatch.setenv("PAGODA_CACHE_DIR", "~/elsewhere")
    assert environment.cache_dir() == Path("~/elsewhere").expanduser()
    with pytest.raises(KeyError):
        environment.read("PAGODA_NOT_A_VARIABLE")


def test_pagoda_env_lists_every_variable_with_its_value_here(capsys, monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_LINEAR", "blocked")
    assert main(["env"]) == 0
    printed = capsys.readouterr().out
    for name in environment.VARIABLES:
        assert name in printed
    line = next(line for line in printed.splitlines() if line.startswith("PAGODA_CPU_LINEAR "))
    assert "blocked" in line
