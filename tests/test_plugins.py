"""The plugin API: built-in policies, a pip-installed third-party plugin, failures."""

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.frontend.async_engine import AsyncEngine
from pagoda.engine.config import EngineConfig
from pagoda.engine.core.plugin_manager import create_plugin_manager, plugin_names
from pagoda.engine.core.policy import Policy
from pagoda.engine.exceptions import RequestRejected
from pagoda.plugins import RetryLater, hookimpl
from pagoda.plugins.scheduling import SchedulingPolicy

EXAMPLE = Path(__file__).parent / "plugin_example"


class Recorder:
    """An observer plugin: finish order and step count."""

    def __init__(self):
        self.finished: list[tuple[str, str]] = []
        self.arrivals: list[float] = []
        self.steps = 0

    @hookimpl
    def pagoda_request_finished(self, request, finish_reason):
        self.finished.append((request.request_id, finish_reason))
        self.arrivals.append(request.arrival_time)

    @hookimpl
    def pagoda_step_finished(self, step):
        self.steps += 1


def run_late_high_priority(model_dir, policy):
    """Three long low-priority requests run; a short high-priority one arrives last."""
    recorder = Recorder()
    pm = create_plugin_manager(load_entry_points=False, extra=[recorder])
    config = EngineConfig(model=str(model_dir), enforce_eager=True, dtype="float32", max_model_len=128, num_kv_blocks=64,
                          max_num_seqs=3, scheduling_policy=policy)

    async def main():
        async with AsyncEngine(config, pm) as engine:
            long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

            async def consume(prompt, params, request_id, priority, started=None):
                async for out in engine.generate(prompt, params, request_id, priority=priority):
                    if started is not None and out.outputs[0].token_ids:
                        started.set()

            started = [asyncio.Event() for _ in range(3)]
            tasks = [asyncio.create_task(consume(f"background job {i}", long, f"low-{i}", 5, started[i]))
                     for i in range(3)]
            await asyncio.gather(*(event.wait() for event in started))
            tasks.append(asyncio.create_task(consume("urgent", SamplingParams(temperature=0, max_tokens=5,
                                                                              ignore_eos=True), "high", 0)))
            await asyncio.gather(*tasks)
            return engine.scheduler.stats.num_preemptions

    preemptions = asyncio.run(main())
    return [request_id for request_id, _ in recorder.finished], preemptions, recorder


def test_priority_lets_a_late_high_priority_request_finish_first(tiny_llama_dir):
    order, preemptions, recorder = run_late_high_priority(tiny_llama_dir, "priority")
    assert order[0] == "high"
    assert preemptions > 0
    assert recorder.steps > 0


def test_fcfs_keeps_arrival_order(tiny_llama_dir):
    order, preemptions, recorder = run_late_high_priority(tiny_llama_dir, "fcfs")
    assert order[-1] == "high"
    assert recorder.arrivals == sorted(recorder.arrivals)  # finished in arrival order
    assert preemptions == 0


def test_unknown_policy_lists_the_known_ones(tiny_llama_dir):
    with pytest.raises(ValueError, match="fcfs, priority, shortest-prompt-first"):
        LLM(str(tiny_llama_dir), scheduling_policy="lottery")
    with pytest.raises(ValueError, match="lru, retention-priority"):
        LLM(str(tiny_llama_dir), eviction_policy="random")


class Exploding(SchedulingPolicy):
    """A scheduling policy whose every decision raises."""

    def sort_key(self, request):
        raise RuntimeError("sort key exploded")

    def select_victim(self, running, needing, needing_is_running):
        raise RuntimeError("victim chooser exploded")


class Broken:
    """A plugin with the exploding policy and an observer that raises."""

    @hookimpl
    def pagoda_scheduling_policies(self):
        return {"exploding": Exploding}

    @hookimpl
    def pagoda_step_finished(self, step):
        raise RuntimeError("observer exploded")


def test_a_raising_plugin_falls_back_to_the_builtin_policy(tiny_llama_dir, caplog):
    pm = create_plugin_manager(load_entry_points=False, extra=[Broken()])
    prompts = [f"Request {i} with a few words to fill the cache" for i in range(12)]
    with LLM(str(tiny_llama_dir), plugin_manager=pm, enforce_eager=True, dtype="float32", block_size=4, num_kv_blocks=40,
             max_model_len=64, preemption_mode="recompute", scheduling_policy="exploding") as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 20 for o in outputs)
        assert llm.engine.scheduler.stats.num_preemptions > 0
        assert llm.engine.policy.num_plugin_errors > 0
        errors = {r.getMessage().split(" failed")[0] for r in caplog.records if r.levelname == "ERROR"}
        assert errors == {"scheduling policy 'exploding': sort_key", "scheduling policy 'exploding': select_victim",
                          "plugin hook pagoda_step_finished"}, errors  # each logged once, named
        kv = llm.engine.scheduler.kv_cache_manager
        assert kv.get_num_free_blocks() == kv.num_blocks


class Quota:
    @hookimpl
    def pagoda_admit_request(self, request, num_waiting, num_running):
        return "over quota" if request.priority < 0 else None


def test_admission_plugin_rejects_with_its_reason(tiny_llama_dir):
    pm = create_plugin_manager(load_entry_points=False, extra=[Quota()])
    with LLM(str(tiny_llama_dir), plugin_manager=pm, enforce_eager=True, dtype="float32", max_model_len=64, num_kv_blocks=32) as llm:
        with pytest.raises(RequestRejected, match="over quota"):
            llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[0, -1])
        assert llm.generate("c", SamplingParams(max_tokens=2))[0].finished


def test_policy_without_plugins_uses_builtins():
    policy = Policy()
    assert policy.make_evictor().__class__.__name__ == "LRUEvictor"
    assert type(policy.scheduling) is SchedulingPolicy  # fcfs


def test_each_engine_builds_its_own_policy_object():
    pm = create_plugin_manager(load_entry_points=False)
    first, second = Policy(pm, "fair"), Policy(pm, "fair")
    assert first.scheduling is not second.scheduling and first.sort_keys_change


class OldStyle:
    """A plugin written to the hooks before scheduling policies were objects."""

    @hookimpl
    def pagoda_scheduling_policies(self):
        return ["newest-first"]

    @hookimpl
    def pagoda_request_sort_key(self, policy, request):
        return (-request.arrival_time,) if policy == "newest-first" else None


class OldStyleListOnly:
    @hookimpl
    def pagoda_scheduling_policies(self):
        return ["newest-first"]


class Twice:
    @hookimpl
    def pagoda_scheduling_policies(self):
        return {"fcfs": SchedulingPolicy}


def test_a_plugin_on_the_old_scheduling_hooks_gets_a_message_that_says_what_replaced_them():
    with pytest.raises(ValueError, match="implements pagoda_request_sort_key, which Pagoda no longer calls.*"
                                         "SchedulingPolicy.*name: factory"):
        create_plugin_manager(load_entry_points=False, extra=[OldStyle()])
    pm = create_plugin_manager(load_entry_points=False, extra=[OldStyleListOnly()])
    with pytest.raises(ValueError, match=r"must return \{name: factory\}.*not \['newest-first'\]"):
        Policy(pm, "newest-first")
    pm = create_plugin_manager(load_entry_points=False, extra=[Twice()])
    with pytest.raises(ValueError, match="'fcfs' is registered by both pagoda-builtin and"):
        Policy(pm)


@pytest.fixture(scope="module")
def installed_example_plugin(tmp_path_factory):
    # NOTE: installed from a copy, so that the build leaves no build/ or *.egg-info in the tree.
    source = tmp_path_factory.mktemp("plugin") / "pagoda-example-plugin"
    shutil.copytree(EXAMPLE, source)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["install", "--no-deps", "--no-build-isolation", str(source)], check=True,
                   timeout=300)
    yield
    subprocess.run(pip + ["uninstall", "-y", "pagoda-example-plugin"], check=True, timeout=120)


@pytest.mark.slow
def test_pip_installed_plugin_runs_when_named(installed_example_plugin, tiny_llama_dir):
    script = textwrap.dedent(f"""
        from pagoda import LLM, SamplingParams
        from pagoda.engine.exceptions import RequestRejected

        if __name__ == "__main__":
            prompts = ["short", "a somewhat longer prompt here", "the longest prompt of them all, by several words"]
            with LLM({str(tiny_llama_dir)!r}, enforce_eager=True, dtype="float32", max_model_len=64, num_kv_blocks=64,
                     max_num_seqs=1, scheduling_policy="longest-prompt-first") as llm:
                outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
                order = sorted(range(3), key=lambda i: outs[i].metrics.finished_time)
                print("ORDER", order)
                try:
                    llm.generate([[1000] * 30], SamplingParams(max_tokens=1))
                except RequestRejected as exc:
                    print("REJECTED", exc)
    """)
    env = {**os.environ, "PAGODA_EXAMPLE_MAX_PROMPT_TOKENS": "20"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "ORDER [2, 1, 0]" in result.stdout
    assert "REJECTED request rejected: prompts are limited to 20 tokens by the example quota" in result.stdout


@pytest.mark.slow
def test_plugin_named_on_the_command_line(tiny_llama_dir):
    # NOTE: the example module is found through PYTHONPATH, as a user's own module is.
    env = {**os.environ, "PAGODA_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(EXAMPLE), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run(
        [sys.executable, "-m", "pagoda", "generate", "--raw", "hi", "--model", str(tiny_llama_dir), "--max-model-len",
         "64", "--enforce-eager", "--num-kv-blocks", "32", "--max-tokens", "2", "--plugin", "pagoda_example_plugin",
         "--scheduling-policy", "longest-prompt-first"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_installed_plugin_named_again_with_plugin_flag_is_loaded_once(installed_example_plugin, tiny_llama_dir):
    pm = create_plugin_manager(plugins=["pagoda_example_plugin", "pagoda_example_plugin"])
    example = sys.modules["pagoda_example_plugin"]
    assert [name for name, plugin in pm.list_name_plugin() if plugin is example] == ["example"]
    assert plugin_names(pm) == ["pagoda_example_plugin"]  # one name, however it was loaded
    # The whole start-up, as a user runs it: the entry point and --plugin both name it.
    result = subprocess.run(
        [sys.executable, "-m", "pagoda", "generate", "--raw", "hi", "--model", str(tiny_llama_dir), "--max-model-len",
         "64", "--enforce-eager", "--num-kv-blocks", "32", "--max-tokens", "2", "--plugin", "pagoda_example_plugin",
         "--scheduling-policy", "longest-prompt-first"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr
    assert "already registered" not in result.stderr


class CountingQuota:
    """Refuses 3-token prompts for good, and 4-token prompts for a while."""

    def __init__(self):
        self.calls = 0

    @hookimpl
    def pagoda_admit_request(self, request, num_waiting, num_running):
        self.calls += 1
        if request.num_prompt_tokens == 3:
            return "this prompt is not allowed"
        if request.num_prompt_tokens == 4:
            return RetryLater("the quota refills in a moment", retry_after=2.5)
        return None


def test_plugin_rejection_is_a_403_clients_do_not_retry_and_retry_later_a_429(tiny_llama_dir):
    import openai

    from pagoda.server.testing import ServerThread, http_request

    config = EngineConfig(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=64,
                          num_kv_blocks=32, plugins=("test_plugins:CountingQuota",))
    with ServerThread(config) as server:
        quota = server.engine.plugin_manager.get_plugin("test_plugins:CountingQuota")
        # NOTE: the client's default retries (2), as an application has them.
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        model = client.models.list().data[0].id
        with pytest.raises(openai.PermissionDeniedError) as refused:
            client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=2)
        assert refused.value.status_code == 403 and refused.value.code == "request_rejected"
        assert "this prompt is not allowed" in refused.value.message
        assert quota.calls == 1  # sent once: a permanent refusal is not retried

        busy = http_request(server.url + "/v1/completions", "POST",
                            json={"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 2})
        assert busy.status == 429 and busy.headers["Retry-After"] == "3"
        assert busy.json()["error"]["code"] == "rate_limited"
        out = client.completions.create(model=model, prompt=[1, 2, 3, 4, 5], max_tokens=2)
        assert out.choices[0].finish_reason in ("stop", "length")
        kv = server.call(lambda: server.engine.scheduler.kv_cache_manager)
        assert server.call(kv.get_num_free_blocks) == kv.num_blocks


class NewestFirst(SchedulingPolicy):
    """A policy that only orders the queue: victims are the base class's (fcfs)."""

    def sort_key(self, request):
        return (-request.arrival_time,)


class SortKeyOnly:
    @hookimpl
    def pagoda_scheduling_policies(self):
        return {"newest-first": NewestFirst}


def test_policy_with_only_a_sort_key_preempts_without_plugin_errors(tiny_llama_dir, caplog):
    pm = create_plugin_manager(load_entry_points=False, extra=[SortKeyOnly()])
    prompts = [f"Request {i} with a few words to fill the cache" for i in range(12)]
    with LLM(str(tiny_llama_dir), plugin_manager=pm, enforce_eager=True, dtype="float32", block_size=4,
             num_kv_blocks=40, max_model_len=64, preemption_mode="recompute", scheduling_policy="newest-first") as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 20 for o in outputs)
        assert llm.engine.scheduler.stats.num_preemptions > 0
        assert llm.engine.policy.num_plugin_errors == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
