"""The model-free benchmark commands run and report what they claim."""

import json
import sys
import re
from pathlib import Path

import pytest

from pagoda.cli.main import build_parser, main


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


def test_overhead_bench_streams_deltas_and_accounts_for_the_step(capsys, tiny_llama_dir):
    assert main(["bench", "overhead", "--model", str(tiny_llama_dir), "--num-requests", "12", "--input-len", "5",
                 "--output-len", "7", "--output-kind", "delta", "--dtype", "float32", "--enforce-eager", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["async_scheduling"] for r in rows] == [False, True]
    for r in rows:
        assert r["output_kind"] == "delta"
        assert r["steps"] >= 7  # a prefill and a decode per output token (the first comes with the prefill)
        assert r["worker_compute_ms_per_step"] > 0
        assert r["engine_ms_per_step"] == pytest.approx(r["schedule_ms_per_step"] + r["update_ms_per_step"])
        assert r["outside_forward_ms_per_step"] == pytest.approx(
            r["wall_ms_per_step"] - r["worker_compute_ms_per_step"])


def test_compare_workloads_draw_fresh_prompts_of_their_shape():
    from pagoda.benchmarks.workloads import WORKLOADS

    for workload in WORKLOADS.values():
        prompts, output_lens = workload.draw(seed=1, vocab_size=49152)
        again, _ = workload.draw(seed=1, vocab_size=49152)
        other, _ = workload.draw(seed=2, vocab_size=49152)
        assert len(prompts) == len(output_lens) == workload.count
        assert prompts == again and prompts != other  # reproducible per run, fresh between runs
        assert all(len(p) + n <= workload.max_len for p, n in zip(prompts, output_lens))
    prompts, output_lens = WORKLOADS["shared-prefix"].draw(seed=0, vocab_size=49152)
    assert len({tuple(p[:512]) for p in prompts}) == 1 and len({tuple(p[512:]) for p in prompts}) == len(prompts)
    _, output_lens = WORKLOADS["prefill"].draw(seed=0, vocab_size=49152)
    assert set(output_lens) == {1}


def test_linear_bench_times_every_packing_this_machine_has(capsys):
    from pagoda.native import library as kernel_library
    from pagoda.engine.models import linear

    status = main(["bench", "linear", "--rows", "1,7", "--layers", "2", "--repeats", "1", "--hidden-size", "64",
                   "--intermediate-size", "96", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "8", "--json"])
    out = capsys.readouterr().out
    available = {packing for packing in linear.PACKINGS if linear.packing_available(packing)}
    if kernel_library.available():
        available |= {"q8", "q4m"}
    if not available:  # no C compiler and no bfloat16 kernels: nothing to time, and it says so
        assert status == 1 and "no packing is available" in out
        return
    assert status == 0
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["rows"] for r in rows] == [1, 7]
    for r in rows:
        timed = {key.removesuffix("_ms") for key in r if key.endswith("_ms")}
        assert timed == available
        # NOTE: one repeat of a tiny shape: well under 0.1 GFLOP/s, which must not print as 0.
        assert all(r[f"{name}_ms"] > 0 and r[f"{name}_gflops"] > 0 for name in timed)


def test_fairness_bench_serves_the_light_client_sooner_under_fair(capsys, tiny_llama_dir):
    assert main(["bench", "fairness", "--model", str(tiny_llama_dir), "--num-light", "2", "--ratio", "5",
                 "--input-len", "5", "--output-len", "12", "--max-num-seqs", "2", "--dtype", "float32",
                 "--enforce-eager", "--json"]) == 0
    rows = {r["policy"]: r for r in (json.loads(line) for line in capsys.readouterr().out.splitlines()
                                     if line.startswith("{"))}
    assert rows["fcfs"]["heavy"]["requests"] == 10 and rows["fair"]["light"]["requests"] == 2
    # fcfs serves in arrival order (5 heavy, then 1 light, ...); fair alternates the clients.
    assert rows["fcfs"]["light"]["last_finished_after"] >= 10  # behind every heavy request (2 slots)
    assert rows["fair"]["light"]["last_finished_after"] <= 5


def test_compare_names_the_cpu_in_its_table_and_json(capsys, tmp_path, tiny_llama_dir):
    from pagoda.benchmarks.compare import describe_cpu

    cpu = describe_cpu()
    flags = open("/proc/cpuinfo").read()
    assert cpu["model_name"] in flags and cpu["cores"] >= 1
    assert ("amx_bf16" in cpu["features"]) == (" amx_bf16" in flags)
    output = tmp_path / "compare.json"
    assert main(["bench", "compare", "--model", str(tiny_llama_dir), "--workloads", "single,batch8,prefill",
                 "--runs", "1", "--dtype", "float32", "--enforce-eager", "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert f"CPU: {cpu['model_name']}" in out
    assert re.search(r"^precision: pagoda float32, \d+ MB of weights$", out, re.M), out
    records = json.loads(output.read_text())
    rates, weight_bytes = records[0].pop("read_rates_gb_per_s"), records[0].pop("pagoda_weight_bytes_per_token")
    assert records[0] == {"engine": "machine", "event": "cpu", **cpu}
    # The bytes a decoded token reads: every weight of the float32 checkpoint, the embedding
    # table too (the head is tied to it and multiplies it whole).
    from safetensors.torch import load_file

    tensors = load_file(tiny_llama_dir / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert weight_bytes == sum(t.numel() * 4 for t in tensors.values())
    # As it goes: the memory read rate (measured before the engine starts), a line before the
    # engine starts, one when it has, one per run (warm-up and timed), in order, each with its
    # time; then the table, a row per workload, and the single stream's and the small batch's
    # bandwidth floor.
    lines = out.splitlines()
    # The read rate before the engine and after the runs (the floor takes the higher).
    assert len(rates) == 2 and min(rates) > 0.5
    for when, rate, line in zip(("before pagoda", "after the runs"), rates, (lines[0], lines[9])):
        assert line == f"memory read rate {when}: {rate:.2f} GB/s (for the decode's bandwidth floor)"
    del lines[9], lines[0]
    assert lines[0].startswith("pagoda: starting the engine on") and re.fullmatch(r"pagoda: started in [0-9.]+ s",
                                                                                  lines[1])
    runs = [re.fullmatch(r"pagoda +(\S+) +(warm-up|run 1/1) +([0-9.]+) s +([0-9.]+) tok/s", line)
            for line in lines[2:8]]
    assert [(m[1], m[2]) for m in runs] == [(name, run) for name in ("single", "batch8", "prefill")
                                            for run in ("warm-up", "run 1/1")], lines
    timed = [r for r in records[1:] if r.get("event") == "run" and not r["warmup"]]
    assert [float(runs[i][3]) for i in (1, 3, 5)] == [round(r["seconds"], 2) for r in timed]
    assert not any(line.startswith("{") for line in lines)  # JSON only with --json
    table = lines[lines.index(next(line for line in lines if line.startswith("workload"))):]
    assert len(table) == 6 and table[1].startswith("1 x ") and table[2].startswith("8 x ") and "prompt" in table[3]
    for line, record, rows in zip(table[4:], timed, (1, 8)):
        floor = re.fullmatch(r"bandwidth floor: ([0-9.]+) GB of weights read per step \(Pagoda's\) at ([0-9.]+) GB/s, "
                             r"the highest read rate of the sitting \(measured ([0-9.]+)-([0-9.]+) GB/s\), = ([0-9.]+) "
                             r"ms/step; (1|8) x 128 (?:random prompt )?-> 128 out \((single stream|small batch)\) "
                             r"\(its prefill included\): pagoda ([0-9.]+) ms/step \(([0-9.]+)x the floor\)", line)
        assert floor and int(floor[6]) == rows, line
        assert float(floor[1]) == round(weight_bytes / 1e9, 2)
        assert [float(floor[i]) for i in (3, 4, 2)] == pytest.approx([min(rates), max(rates), max(rates)], abs=0.06)
        per_step = record["seconds"] / (record["output_tokens"] / rows)
        floor_seconds = weight_bytes / (max(rates) * 1e9)
        assert float(floor[5]) == pytest.approx(floor_seconds * 1e3, rel=0.01, abs=0.06)
        assert float(floor[8]) == round(per_step * 1e3, 1)
        assert float(floor[9]) == pytest.approx(per_step / floor_seconds, rel=0.01, abs=0.01)


def test_compare_against_vllm_is_at_equal_precision_unless_told_otherwise(tmp_path):
    from argparse import Namespace

    from pagoda.benchmarks.compare import precision_line
    from pagoda.engine.model_loader import default_gguf_path, resolve_model

    gguf = resolve_model(None)  # the default model: a GGUF file, run as it ships with --quantization auto
    args = Namespace(peer="vllm", dtype="bfloat16", device="cpu", tensor_parallel_size=1, gguf=None,
                     pagoda_weights="bfloat16, 270 MB of weights", quantization="none")
    assert precision_line(args, gguf) == "precision: pagoda bfloat16, 270 MB of weights; vllm bfloat16, dense weights"
    args.quantization = "auto"
    assert "MIXED PRECISION" in precision_line(args, gguf)
    args.peer, args.gguf = "llamacpp", default_gguf_path()
    assert precision_line(args, gguf).endswith(f"llama.cpp the GGUF file {Path(args.gguf).name} as it ships")
    parser = build_parser()
    assert parser.parse_args(["bench", "compare"]).quantization is None  # resolved by the peer


def test_the_peer_gets_the_dtype_dense_weights_run_in_here():
    from pagoda.benchmarks.compare import peer_dtype
    from pagoda.engine.platform import cpu_has_fast_bf16

    # NOTE: "auto" is float32 for dense weights on CPUs without native bf16 (AVX2-only): the peer
    # must not get bf16 there (vLLM's bf16 products fall back to one slow thread)
    assert peer_dtype("auto") == ("bfloat16" if cpu_has_fast_bf16() else "float32")
    assert [peer_dtype(d) for d in ("float32", "bfloat16", "float16")] == ["float32", "bfloat16", "float16"]


def test_kv_cache_dtype_bench_times_each_cache_dtype(capsys):
    assert main(["bench", "kv-cache-dtype", "--cases", "4x64", "--kv-cache-dtypes", "auto,fp8,fp8_e5m2",
                 "--layers", "2", "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["kv_cache_dtype"] for r in rows] == ["auto", "fp8", "fp8_e5m2"]
    assert rows[0]["speedup"] == 1.0 and all(r["ms"] > 0 and r["cache_gb_per_s"] > 0 for r in rows)


def test_cascade_bench_times_the_kernel_against_the_cascade(capsys):
    from pagoda.attention_backends import cpu_kernels, cpu_paged
    from pagoda.native import library as kernel_library

    if not kernel_library.available():
        pytest.skip("no C compiler for the CPU kernels")
    thresholds = cpu_paged.CASCADE_MIN_REQUESTS, cpu_paged.CASCADE_MIN_TOKENS
    assert main(["bench", "cascade", "--cases", "2x32,9x256", "--own", "8", "--layers", "2", "--repeats", "1",
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["requests"], r["shared_tokens"]) for r in rows] == [(2, 32), (9, 256)]
    assert all(r["kernel_ms"] > 0 and r["cascade_ms"] > 0 for r in rows)
    # Whether the default thresholds take each case: 2 requests never; 9 over 256 on AMX tiles
    # and AVX2's float32 tiles only.
    tiles = cpu_kernels.attention_tiles()
    assert [r["taken_by_default"] for r in rows] == [False, tiles in ("amx", "avx2")]
    assert {r["shared_part"] for r in rows} == {tiles or "torch"}
    assert (cpu_paged.CASCADE_MIN_REQUESTS, cpu_paged.CASCADE_MIN_TOKENS) == thresholds  # put back
    # One of 9 requests over blocks of its own: the other 8, a cascade of members, on the same tiles.
    assert main(["bench", "cascade", "--cases", "9x256", "--apart", "1", "--own", "8", "--layers", "2",
                 "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["apart"], r["taken_by_default"]) for r in rows] == [(1, tiles in ("amx", "avx2"))]


def test_scoring_bench_reports_each_mode_against_prefill(capsys, tmp_path, tiny_llama_dir):
    output = tmp_path / "scoring.json"
    assert main(["bench", "scoring", "--model", str(tiny_llama_dir), "--num-requests", "4", "--input-len", "24",
                 "--runs", "1", "--num-top", "2", "--dtype", "float32", "--enforce-eager", "--output",
                 str(output)]) == 0
    out = capsys.readouterr().out
    assert "CPU:" in out and "vs prefill" in out
    modes = json.loads(output.read_text())["modes"]
    assert set(modes) == {"prefill", "embed", "prompt_logprobs"}
    assert modes["prefill"]["ratio_to_prefill"] == 1.0
    assert all(m["prompt_tokens_per_s"] > 0 for m in modes.values())


def test_serve_bench_scenarios_and_its_clear_error_without_vllms_client(capsys):
    from pagoda.benchmarks.serve import parse_scenario

    assert parse_scenario("concurrency:32") == ("concurrency:32", ["--max-concurrency", "32", "--request-rate", "inf"])
    assert parse_scenario("rate:2.5") == ("rate:2.5", ["--request-rate", "2.5"])
    for bad in ("concurrency:x", "rate:fast", "burst:3"):
        with pytest.raises(ValueError):
            parse_scenario(bad)
    assert main(["bench", "serve", "--peer", "none"]) == 2
    assert "--vllm-python" in capsys.readouterr().err


def test_serve_bench_runs_pagoda_at_vllms_precision_unless_told_otherwise():
    from pagoda.benchmarks.serve import resolve_quantization, server_command

    def pagoda_command(*flags):
        args = build_parser().parse_args(["bench", "serve", "--vllm-python", sys.executable, *flags])
        resolve_quantization(args)
        command, _ = server_command("pagoda", args, Path("/models/m"), "m")
        return command[command.index("--quantization") + 1]

    assert pagoda_command() == "none"  # vLLM serves dense weights: so does Pagoda
    assert pagoda_command("--peer", "none") == "auto"  # alone: the GGUF file as it ships
    assert pagoda_command("--quantization", "auto") == "auto"


def test_compare_with_llamacpp_names_what_it_needs(capsys, tmp_path):
    assert main(["bench", "compare", "--peer", "llamacpp", "--runs", "1"]) == 2
    assert "--llamacpp-python" in capsys.readouterr().err
    assert main(["bench", "compare", "--peer", "llamacpp", "--llamacpp-python", sys.executable, "--gguf",
                 str(tmp_path / "missing.gguf"), "--runs", "1"]) == 2
    assert "missing.gguf: no such file" in capsys.readouterr().err


def test_speculative_bench_reports_both_engines(capsys, tmp_path, tiny_llama_dir):
    output = tmp_path / "spec.json"
    assert main(["bench", "speculative", "--model", str(tiny_llama_dir), "--workloads", "random-greedy",
                 "--runs", "1", "--dtype", "float32", "--enforce-eager", "--output", str(output)]) == 0
    assert "speed-up" in capsys.readouterr().out
    result = json.loads(output.read_text())
    for engine in ("without", "with"):
        assert result[engine]["random-greedy"]["output_tokens_per_s"] > 0
    assert result["without"]["random-greedy"]["draft_tokens"] == 0


def test_random_model_gguf_files_say_what_they_need(capsys, tiny_llama_dir):
    # A model already in --output is kept; quantized types are llama.cpp's, written by its quantizer.
    args = ["bench", "random-model", "llama-1b", "--output", str(tiny_llama_dir), "--gguf"]
    assert main([*args, "Q4_K_M", "--llamacpp-python", ""]) == 2
    assert "llama.cpp's quantizer: give --llamacpp-python" in capsys.readouterr().err
    assert main([*args, "Q3_XYZ"]) == 2
    assert "unknown GGUF types ['Q3_XYZ']; known: f16, Q4_0" in capsys.readouterr().err
    assert not list(Path(tiny_llama_dir).glob("*.gguf"))


@pytest.mark.slow
def test_random_model_writes_a_float16_gguf_with_the_default_models_tokenizer(tmp_path):
    # The tiny model (the default model's vocabulary) as a float16 GGUF file: llama.cpp's names,
    # 2-D tensors in float16, norms in float32, every tokenizer field of the default model's file;
    # Pagoda serves it with the directory's prompt logprobs up to float16's rounding.
    import gguf
    import torch

    from pagoda import LLM, SamplingParams
    from pagoda.engine.model_loader import default_gguf_path
    from helpers import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "tiny", "llama", vocab_size=49152, hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2)
    assert main(["bench", "random-model", "llama-1b", "--output", str(model_dir), "--gguf", "f16"]) == 0
    path = model_dir / "llama-1b.f16.gguf"
    reader, default = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(default_gguf_path()))
    types = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == "F16"
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
    tokenizer = [name for name in default.fields if name.startswith("tokenizer.")]
    assert tokenizer and all(reader.fields[name].contents() == default.fields[name].contents() for name in tokenizer)
    prompt, params = list(range(300, 340)), SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    logprobs = []
    for model in (model_dir, path):
        with LLM(str(model), dtype="float32", enforce_eager=True, max_model_len=64) as llm:
            out = llm.generate([prompt], params)[0]
        logprobs.append(torch.tensor([entry.logprob for entry in out.prompt_logprobs[1:]]))
    torch.testing.assert_close(logprobs[1], logprobs[0], rtol=0, atol=2e-2)
