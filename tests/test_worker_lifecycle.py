"""The worker starts from any kind of script, and a worker that cannot start says why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagoda import LLM
from pagoda.engine.exceptions import WorkerDiedError

SCRIPT = """\
from pagoda import LLM, SamplingParams

llm = LLM({model!r}, enforce_eager=True, dtype="float32", max_model_len=64, num_kv_blocks=32)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
print("TOKENS", out[0].outputs[0].token_ids)
"""


def run_python(args: list[str], stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=180,
                          cwd=cwd)


def tokens_printed(result: subprocess.CompletedProcess) -> list[int]:
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("TOKENS"))
    return eval(line.removeprefix("TOKENS"))  # noqa: S307 - a list literal we printed


def test_script_without_main_guard_and_script_on_stdin_both_generate(tiny_llama_dir, tmp_path):
    script = SCRIPT.format(model=str(tiny_llama_dir))
    path = tmp_path / "unguarded.py"
    path.write_text(script)
    from_file = tokens_printed(run_python([str(path)], cwd=tmp_path))
    from_stdin = tokens_printed(run_python(["-"], stdin=script, cwd=tmp_path))
    assert len(from_file) == 4
    assert from_file == from_stdin


def test_a_worker_that_fails_to_start_reports_its_traceback(tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in tiny_llama_dir.iterdir():
        target = broken / file.name
        target.write_bytes(b"not a safetensors file" if file.suffix == ".safetensors" else file.read_bytes())
    with pytest.raises(WorkerDiedError) as info:
        LLM(str(broken), enforce_eager=True, dtype="float32", max_model_len=64, num_kv_blocks=32)
    message = str(info.value)
    assert "failed to start" in message and "Traceback" in message
    assert "safetensors" in message.lower()


@pytest.mark.parametrize("user_value", [None, "glibc.malloc.arena_max=2"])
def test_the_worker_gets_the_allocator_tunables_unless_the_user_set_some(tiny_llama_dir, monkeypatch, user_value):
    if user_value is not None:
        monkeypatch.setenv("GLIBC_TUNABLES", user_value)
    with LLM(str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=128) as llm:
        environ = Path(f"/proc/{llm.engine.worker.pid}/environ").read_bytes().split(b"\0")
    tunables = [e.decode() for e in environ if e.startswith(b"GLIBC_TUNABLES=")]
    assert len(tunables) == 1
    if user_value is None:
        assert "glibc.malloc.mmap_threshold=67108864" in tunables[0]
    else:
        assert tunables[0] == f"GLIBC_TUNABLES={user_value}"
