"""The offline LLM API on a tiny model: sampling features, errors, load and failure."""

import os
import fcntl
import signal
import struct
import subprocess
import sys
import termios

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.exceptions import EngineDeadError


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=256, block_size=8, num_kv_blocks=256) as llm:
        yield llm


def assert_all_blocks_free(llm):
    kv = llm.engine.scheduler.kv_cache_manager
    kv.check_invariants()
    assert kv.get_num_free_blocks() == kv.num_blocks


def test_generate_text_and_token_prompts_agree(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_text = llm.generate(["Hello there"], params)[0]
    by_ids = llm.generate([llm.tokenizer.encode("Hello there")], params)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert len(by_text.outputs[0].token_ids) == 8
    assert by_text.outputs[0].finish_reason == "length"
    assert by_text.outputs[0].text == llm.tokenizer.decode(by_text.outputs[0].token_ids, skip_special_tokens=True)
    assert by_text.prompt == "Hello there" and by_text.finished


def test_seeded_sampling_is_reproducible_and_n_samples_differ(llm):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=1234, ignore_eos=True)
    a = llm.generate("Once upon a time", params)[0].outputs[0].token_ids
    # Batched with other requests, the seeded request still gives the same tokens.
    batch = llm.generate(["Once upon a time", "Another prompt entirely"],
                         [params, SamplingParams(temperature=1.0, max_tokens=10)])
    assert batch[0].outputs[0].token_ids == a
    many = llm.generate("Once upon a time", SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=7,
                                                           ignore_eos=True))[0]
    assert [o.index for o in many.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in many.outputs}) > 1
    # Sample i of a seeded n>1 request uses seed + i.
    single = llm.generate("Once upon a time", SamplingParams(temperature=1.0, max_tokens=10, seed=9,
                                                             ignore_eos=True))[0]
    assert single.outputs[0].token_ids == many.outputs[2].token_ids


def test_stop_string_is_left_out_and_stop_token_ends(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate("The weather today", params)[0].outputs[0]
    stop = full.text[5:8]
    assert stop.strip(), "pick a non-blank stop string"
    cut = llm.generate("The weather today", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                           stop=[stop]))[0].outputs[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    stop_id = full.token_ids[3]
    by_token = llm.generate("The weather today", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                stop_token_ids=[stop_id]))[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert by_token.token_ids == full.token_ids[: first + 1]
    assert by_token.stop_reason == stop_id and by_token.finish_reason == "stop"


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate("Logprobs please", SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                         ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token_id
        assert len(lp.top_token_ids) == 3
        # Greedy: the sampled token is the most likely one.
        assert lp.top_token_ids[0] == token_id and lp.logprob == pytest.approx(lp.top_logprobs[0])
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True) and lp.logprob <= 0


def test_min_tokens_and_chat(llm):
    out = llm.chat([{"role": "user", "content": "Say hi"}],
                   SamplingParams(temperature=0, max_tokens=6, min_tokens=6))[0].outputs[0]
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("make, field", [
    (lambda llm: llm.generate("x" * 2000, SamplingParams()), "max_model_len"),
    (lambda llm: llm.generate("", SamplingParams()), "prompt"),
    (lambda llm: llm.generate([[]], SamplingParams()), "prompt"),
    (lambda llm: llm.generate([[10**9]], SamplingParams()), "token ids"),
    (lambda llm: SamplingParams(temperature=-1), "temperature"),
    (lambda llm: SamplingParams(top_p=0), "top_p"),
    (lambda llm: SamplingParams(top_p=1.5), "top_p"),
    (lambda llm: SamplingParams(n=0), "n"),
    (lambda llm: SamplingParams(max_tokens=0), "max_tokens"),
])
def test_bad_input_raises_a_clear_value_error(llm, make, field):
    with pytest.raises(ValueError, match=field):
        make(llm)
    assert_all_blocks_free(llm)


def test_a_failed_batch_runs_nothing(llm):
    stats = llm.engine.scheduler.stats
    generated = stats.num_generation_tokens
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm.generate("still serving", SamplingParams(max_tokens=2, ignore_eos=True))[0].finished
    assert stats.num_generation_tokens == generated + 2
    assert_all_blocks_free(llm)


def test_unknown_model_path_says_where_it_looked(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        LLM(str(missing))


def test_unknown_engine_option_is_rejected():
    with pytest.raises(TypeError, match="max_num_seqz"):
        LLM(max_num_seqz=3)


@pytest.mark.slow
def test_64_requests_under_preemption_all_finish_and_free_every_block(tiny_llama_dir):
    prompts = [f"Request number {i} asks for a few words about paging" for i in range(64)]
    with LLM(str(tiny_llama_dir), enforce_eager=True, dtype="float32", block_size=4, num_kv_blocks=96, max_model_len=64,
             max_num_seqs=32) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert all(o.finished and len(o.outputs[0].token_ids) == 24 for o in outputs)
        assert llm.engine.scheduler.stats.num_preemptions > 0
        assert_all_blocks_free(llm)
        # Preemption changes nothing: the same prompts alone give the same tokens.
        alone = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in outputs[:3]]


def test_a_dead_worker_past_the_restart_budget_fails_requests_instead_of_hanging(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=128, num_kv_blocks=64,
              max_worker_restarts=0)
    try:
        os.kill(llm.engine.worker.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="worker"):
            llm.generate(["a", "b"], SamplingParams(max_tokens=50, ignore_eos=True))
        with pytest.raises(EngineDeadError):
            llm.generate("c", SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_async_scheduling_keeps_two_steps_in_flight_and_changes_no_token(tiny_llama_dir, async_scheduling):
    prompts = [[1000 + 7 * i + j for j in range(5 + 3 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, stop_token_ids=[40000])] * 2
    settings = dict(enforce_eager=True, dtype="float32", max_model_len=64, num_kv_blocks=24, block_size=4)
    with LLM(str(tiny_llama_dir), async_scheduling=async_scheduling, **settings) as llm:
        outputs = llm.generate(prompts, params)
        assert llm.engine.step_stats.max_in_flight == (2 if async_scheduling else 1)
        assert llm.engine.scheduler.stats.num_preemptions > 0  # pending tokens meet preemption too
        assert_all_blocks_free(llm)
    with LLM(str(tiny_llama_dir), async_scheduling=False, num_kv_blocks=256, enforce_eager=True, dtype="float32",
             max_model_len=128, block_size=4) as llm:
        alone = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in alone]


def _run_offline(model_dir, stderr_on_a_terminal: bool) -> str:
    """A script that starts LLM() and generates for three prompts; what it wrote to stderr."""
    code = (f"from pagoda import LLM, SamplingParams\n"
            f"llm = LLM({str(model_dir)!r}, dtype='float32', max_model_len=128, num_kv_blocks=64, enforce_eager=True)\n"
            f"llm.generate(['a', 'b', 'c'], SamplingParams(max_tokens=2))\nllm.shutdown()\n")
    if not stderr_on_a_terminal:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stderr
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's size
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(300) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_offline_start_logs_its_stages_and_generate_shows_a_bar_on_a_terminal(tiny_llama_dir):
    for on_a_terminal in (False, True):
        stderr = _run_offline(tiny_llama_dir, on_a_terminal)
        for stage in ("model: ", "KV cache: ", "starting the worker process", "worker: loading weights",
                      "worker ready: "):
            assert stage in stderr, (stage, stderr)
        assert ("Processed prompts" in stderr and "3/3" in stderr) == on_a_terminal, stderr
