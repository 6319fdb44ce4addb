"""The model-free benchmark commands run and report what they claim."""

import re

from cli.main import main


def test_kv_utilization_bench_reports_paged_above_contiguous(capsys):
    assert main(["bench", "kv-utilization", "--num-requests", "40", "--num-slots", "4096",
                 "--max-model-len", "1024"]) == 0
    utilization = {line[:38].strip(): float(re.search(r"([0-9.]+)%", line).group(1))
                   for line in capsys.readouterr().out.splitlines() if "%" in line}
    assert utilization["paged"] > utilization["contiguous, prompt + max_tokens each"]
    assert utilization["contiguous, prompt + max_tokens each"] > utilization["contiguous, max_model_len each"]


def test_plugins_bench_times_every_hook(capsys):
    assert main(["bench", "plugins", "--num-running", "32", "--num-steps", "60"]) == 0
    out = capsys.readouterr().out
    for hook in ("sort_key", "select_victim", "preemption_mode", "request_finished", "step_finished"):
        assert hook in out
    assert "us per step" in out
