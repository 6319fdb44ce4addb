"""The model-free benchmark commands run and report what they claim."""

from engine.cli import main


def test_kv_utilization_bench_reports_paged_above_contiguous(capsys):
    assert main(["bench", "kv-utilization", "--num-requests", "40", "--num-slots", "4096",
                 "--max-model-len", "1024"]) == 0
    rows = {line.split("  ")[0].strip(): line for line in capsys.readouterr().out.splitlines() if "%" in line}
    paged = float(rows["paged"].split()[1].rstrip("%"))
    reserved = float(rows["contiguous, max_model_len each"].split()[4].rstrip("%"))
    assert paged > reserved


def test_plugins_bench_times_every_hook(capsys):
    assert main(["bench", "plugins", "--num-running", "32", "--num-steps", "60"]) == 0
    out = capsys.readouterr().out
    for hook in ("sort_key", "select_victim", "preemption_mode", "request_finished", "step_finished"):
        assert hook in out
    assert "us per step" in out
