"""Scale-out on this machine: tensor parallelism over gloo, the Ray executor, data-parallel replicas."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import openai
import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.sampling_params import StructuredOutputsParams
from pagoda.engine.tensor_parallel import even_split, head_share
from pagoda.engine.core.plugin_manager import create_plugin_manager
from helpers import GREEDY, NUM_NEW, hf_greedy, make_hf_model
from pagoda.plugins import hookimpl
from pagoda.server.testing import ServerThread, http_request

pytestmark = pytest.mark.slow  # NOTE: `python -m pytest -m slow` runs it (CI runs both sets)

PROMPTS = [[1000 + 7 * i + j for j in range(5 + 9 * i)] for i in range(4)]
TP2 = dict(enforce_eager=True, dtype="float32", tensor_parallel_size=2)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    hf = make_hf_model(tiny_llama_dir)
    return [hf_greedy(hf, p, NUM_NEW) for p in PROMPTS]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_heads_are_split_by_kv_groups_or_replicated():
    assert even_split(10, 0, 3) == (0, 4) and even_split(10, 2, 3) == (7, 10)
    # SmolLM2-135M: 9 query heads over 3 KV heads, on 2 ranks: whole groups of 3.
    assert [(s.q_start, s.q_end, s.kv_start, s.kv_end) for s in (head_share(9, 3, r, 2) for r in range(2))] == \
        [(0, 6, 0, 2), (6, 9, 2, 3)]
    # One KV head, 4 ranks: each rank a quarter of the query heads and a copy of the KV head.
    assert [(head_share(8, 1, r, 4).q_start, head_share(8, 1, r, 4).num_kv_heads) for r in range(4)] == \
        [(0, 1), (2, 1), (4, 1), (6, 1)]
    with pytest.raises(ValueError, match="cannot split"):
        head_share(6, 2, 0, 4)


def test_each_rank_and_replica_gets_its_own_gpu(monkeypatch):
    """cuda:{first + rank} per tensor-parallel rank, tensor_parallel_size GPUs per data-parallel
    replica; asking past the GPUs torch sees is a clear error (the rule, on the CPU: torch's
    view of the GPUs is replaced)."""
    import torch

    from pagoda.engine.frontend.data_parallel import replica_device
    from pagoda.engine.platform import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("cuda", 1) == torch.device("cuda", 1)
    assert resolve_device("cuda:2", 1) == torch.device("cuda", 3)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"needs cuda:4, but torch sees 4 GPUs"):
        resolve_device("cuda:2", 2)
    config = EngineConfig(device="cuda", tensor_parallel_size=2, data_parallel_size=2)
    assert [replica_device(config, i) for i in range(2)] == ["cuda:0", "cuda:2"]
    assert replica_device(EngineConfig(device="cpu", data_parallel_size=2), 1) == "cpu"
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        EngineConfig(device="gpu0")


def test_tp2_matches_transformers_under_swap_preemption(tiny_llama_dir, expected):
    num_blocks = sum(-(-len(p) // 4) for p in PROMPTS) + 1
    with LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=num_blocks, max_model_len=64, preemption_mode="swap",
             swap_space_bytes=1 << 20, **TP2) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        assert llm.engine.scheduler.stats.num_swapped_out > 0
        kv = llm.engine.scheduler.kv_cache_manager
        assert kv.get_num_free_blocks() == kv.num_blocks
    assert token_ids(outputs) == expected


def test_tp2_matches_transformers_on_qwen2_with_biases(tiny_qwen2_dir):
    hf = make_hf_model(tiny_qwen2_dir)
    want = [hf_greedy(hf, p, NUM_NEW) for p in PROMPTS]
    with LLM(str(tiny_qwen2_dir), max_model_len=128, **TP2) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == want


def test_tp2_holds_structured_requests_to_their_grammar(tiny_llama_dir, expected):
    """Rank 0 samples, so only it needs the step's bitmask; unconstrained requests in the
    same steps are untouched."""
    regex = StructuredOutputsParams(regex=r"[a-c]{2,4}")
    choice = StructuredOutputsParams(choice=["alpha", "beta"])
    structured = [SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=40, structured_outputs=c)
                  for c in (regex, choice)]
    with LLM(str(tiny_llama_dir), max_model_len=128, **TP2) as llm:
        outputs = llm.generate(PROMPTS[:2] + PROMPTS, [*structured, *[GREEDY] * len(PROMPTS)])
    for sample in outputs[0].outputs:
        assert re.fullmatch(r"[a-c]{2,4}", sample.text) and sample.finish_reason == "stop"
    for sample in outputs[1].outputs:
        assert sample.text in ("alpha", "beta") and sample.finish_reason == "stop"
    assert token_ids(outputs[2:]) == expected


def test_tp2_prefix_cache_and_copy_on_write_forks(tiny_llama_dir):
    prefix = [2000 + i for i in range(48)]
    with LLM(str(tiny_llama_dir), max_model_len=128, block_size=16, **TP2) as llm:
        first = llm.generate([prefix + [7, 8]], GREEDY)[0]
        stats = llm.engine.scheduler.stats
        hits = stats.prefix_cache_hits
        cached = llm.generate([prefix + [9, 10]], GREEDY)[0]
        assert stats.prefix_cache_hits - hits == 48
        llm.reset_prefix_cache()
        uncached = llm.generate([prefix + [9, 10]], GREEDY)[0]
        assert cached.outputs[0].token_ids == uncached.outputs[0].token_ids != first.outputs[0].token_ids
        forks = llm.generate([prefix], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
        alone = llm.generate([prefix] * 4, [SamplingParams(temperature=1.0, seed=3 + i, max_tokens=8, ignore_eos=True)
                                            for i in range(4)])
        assert stats.num_forks == 3
        assert [o.token_ids for o in forks[0].outputs] == token_ids(alone)


def test_tp2_equals_tp1_on_smollm2_135m():
    prompts = ["What is the capital of France?", "Paged attention keeps keys and values in blocks"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(enforce_eager=True, dtype="float32", max_model_len=256) as llm:
        one = token_ids(llm.generate(prompts, params))
    with LLM(max_model_len=256, **TP2) as llm:
        assert llm.engine.worker.ready.attention_backend in ("cpu_paged", "torch_sdpa")
        two = token_ids(llm.generate(prompts, params))
    assert one == two


def test_ray_executor_on_a_local_cluster_matches_transformers(tiny_llama_dir, expected):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'pagoda[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with LLM(str(tiny_llama_dir), max_model_len=128, distributed_executor_backend="ray", **TP2) as llm:
            outputs = llm.generate(PROMPTS, GREEDY)
            assert llm.engine.worker.ready.pid != os.getpid()
    finally:
        ray.shutdown()
    assert token_ids(outputs) == expected


class KillRankAtStep:
    """Kills one tensor-parallel rank when a given step finishes."""

    def __init__(self, step_id: int) -> None:
        self.step_id = step_id
        self.pid = None

    @hookimpl
    def pagoda_step_finished(self, step):
        if step.step_id == self.step_id and self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)


def test_tp2_restarts_every_rank_when_one_dies(tiny_llama_dir, expected):
    killer = KillRankAtStep(step_id=4)
    pm = create_plugin_manager(load_entry_points=False, extra=[killer])
    with LLM(str(tiny_llama_dir), plugin_manager=pm, max_model_len=128, async_scheduling=False, **TP2) as llm:
        old = llm.engine.worker.pids
        killer.pid = old[1]
        outputs = llm.generate(PROMPTS, GREEDY)
        assert llm.engine.num_worker_restarts == 1
        assert not set(llm.engine.worker.pids) & set(old)
    assert token_ids(outputs) == expected


def test_dp2_both_replicas_serve_and_a_shared_prefix_goes_where_it_is_cached(tiny_llama_dir, expected):
    config = EngineConfig(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=128,
                          block_size=16, data_parallel_size=2)
    with ServerThread(config) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        args = dict(model=model, max_tokens=NUM_NEW, temperature=0, extra_body={"ignore_eos": True})
        got = [client.completions.create(prompt=p, **args).choices[0] for p in PROMPTS]
        router = server.engine.router
        assert all(n > 0 for n in router.stats.per_replica)  # both replicas served
        tokenizer = server.engine.tokenizer
        assert [c.text for c in got] == [tokenizer.decode(ids, skip_special_tokens=True,
                                                          clean_up_tokenization_spaces=False) for ids in expected]

        prefix = [3000 + i for i in range(64)]
        client.completions.create(prompt=prefix + [1], **args)
        holder = next(i for i, r in enumerate(server.engine.replicas)
                      if r.scheduler.kv_cache_manager.num_cached_prefix_tokens(prefix + [2]) == 64)
        before = server.engine.replicas[holder].scheduler.stats.prefix_cache_hits
        by_prefix = router.stats.num_by_prefix
        for suffix in range(3):
            client.completions.create(prompt=prefix + [10 + suffix], **args)
        assert router.stats.num_by_prefix - by_prefix == 3
        assert server.engine.replicas[holder].scheduler.stats.prefix_cache_hits - before == 3 * 64
        metrics = http_request(server.url + "/metrics").text
        assert 'engine="0"' in metrics and 'engine="1"' in metrics
        # on the CPU the replicas share the cores: at most half of them each, not each all of them
        cpus = len(os.sched_getaffinity(0))
        assert all(1 <= r.config.num_threads <= max(1, cpus // 2) for r in server.engine.replicas)


def test_replica_configs_share_the_cpus_unless_told_otherwise():
    from pagoda.engine.frontend.data_parallel import replica_config

    half = max(1, len(os.sched_getaffinity(0)) // 2)
    shared = [replica_config(EngineConfig(device="cpu", data_parallel_size=2), i) for i in range(2)]
    assert [c.num_threads for c in shared] == [half, half] and all(c.data_parallel_size == 1 for c in shared)
    # tensor-parallel ranks in each replica: four workers on the same CPUs
    assert replica_config(EngineConfig(device="cpu", data_parallel_size=2, tensor_parallel_size=2), 0).num_threads \
        == max(1, len(os.sched_getaffinity(0)) // 4)
    assert replica_config(EngineConfig(device="cpu", data_parallel_size=2, num_threads=3), 1).num_threads == 3


DP_SCRIPT = """\
from pagoda import LLM, SamplingParams

with LLM(max_model_len=64, data_parallel_size=2) as llm:
    outputs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    print("TOKENS", [o.outputs[0].token_ids for o in outputs])
"""


def test_dp2_starts_in_a_fresh_interpreter(tmp_path):
    """The replicas load their tokenizers in threads at once; in a process that had not imported
    transformers yet, one of them failed with ImportError (transformers' lazy names). The
    default model, whose GGUF tokenizer takes long enough to load for the two to meet."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-"], input=DP_SCRIPT,
                            capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TOKENS" in result.stdout


def test_dp2_a_dead_replica_leaves_routing_and_its_waiting_requests_run_on_the_other(tiny_llama_dir):
    """Replica 0's worker killed with no restart left: that engine dies; the requests it had not
    answered are sent to replica 1 and answer what a live engine answers; new requests go to 1."""
    import asyncio

    from pagoda.engine.frontend.data_parallel import DataParallelEngine
    from pagoda.engine.frontend.output_processor import OutputKind

    config = EngineConfig(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=256,
                          num_kv_blocks=64, data_parallel_size=2, max_worker_restarts=0, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[100 + 7 * i + j for j in range(150)] for i in range(8)]

    async def run():
        async with DataParallelEngine(config) as engine:
            async def answer(prompt):
                stream = engine.add_request(prompt, params, output_kind=OutputKind.FINAL)
                final = None
                async for final in engine.stream_outputs(stream):
                    pass
                return final.outputs[0].token_ids

            reference = await asyncio.gather(*(answer(p) for p in prompts))
            tasks = [asyncio.ensure_future(answer(p)) for p in prompts]
            await asyncio.sleep(0)  # NOTE: queued on both replicas (two running each at most)
            engine.replicas[0].core.worker.kill()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            routed = list(engine.router.stats.per_replica)
            after = await answer(prompts[0])
            serving = [replica.is_running for replica in engine.replicas]
            return reference, results, engine, routed, after, engine.router.stats.per_replica, serving

    reference, results, engine, routed, after, per_replica, serving = asyncio.run(run())
    assert serving == [False, True]
    assert engine.num_rerouted >= 2  # at least the two waiting behind replica 0's running pair
    # NOTE: final outputs only: nothing was answered before the death, so every request is answered.
    assert results == reference
    assert after == reference[0] and per_replica[1] == routed[1] + 1 and per_replica[0] == routed[0]


RAY_DP_SCRIPT = """\
import json, sys
import ray
from pagoda import LLM, SamplingParams

ray.init(address=sys.argv[2], log_to_driver=False)
with LLM(sys.argv[1], max_model_len=128, enforce_eager=True, dtype="float32", num_kv_blocks=32,
         data_parallel_size=2, distributed_executor_backend="ray") as llm:
    outputs = llm.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16]],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    nodes = [sorted(set(ray.util.placement_group_table(r.core.worker._placement_group)["bundles_to_node_id"].values()))
             for r in llm.engine.replicas]
    served = [r.scheduler.stats.num_generation_tokens for r in llm.engine.replicas]
print("RESULT", json.dumps({"tokens": [o.outputs[0].token_ids for o in outputs], "nodes": nodes, "served": served}))
"""


def test_dp2_on_a_two_node_ray_cluster_puts_one_replica_on_each_node(tiny_llama_dir, tmp_path):
    """`ray start --head` and a second `ray start --address` on this machine, one CPU each: the two
    replicas' placement groups (one each) land on different nodes, and both serve."""
    import json
    import shutil
    import subprocess
    import sys

    pytest.importorskip("ray", reason="Ray is not installed (pip install 'pagoda[ray]')")
    ray_cli = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    from helpers import free_port

    import secrets
    import tempfile

    port = free_port()
    address = f"127.0.0.1:{port}"
    # NOTE: Ray's token authentication, one token for the nodes and the driver.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--object-store-memory", str(80 * 1024**2),
              "--disable-usage-stats"]
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # NOTE: short: Ray's socket paths must fit 107 bytes
    try:
        subprocess.run([ray_cli, "start", "--head", "--port", str(port), "--include-dashboard", "false",
                        "--temp-dir", temp, *common], check=True, env=env, capture_output=True, timeout=120)
        subprocess.run([ray_cli, "start", "--address", address, *common], check=True, env=env, capture_output=True,
                       timeout=120)
        result = subprocess.run([sys.executable, "-", str(tiny_llama_dir), address], input=RAY_DP_SCRIPT, env=env,
                                capture_output=True, text=True, timeout=300, cwd=tmp_path)
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("RESULT", 1)[1])
    (first,), (second,) = report["nodes"]
    assert first != second
    assert all(served > 0 for served in report["served"])
    with LLM(str(tiny_llama_dir), max_model_len=128, enforce_eager=True, dtype="float32", num_kv_blocks=32) as llm:
        local = llm.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16]],
                             SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert report["tokens"] == [o.outputs[0].token_ids for o in local]
