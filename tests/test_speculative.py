"""Speculative decoding: prompt-lookup drafts, verified in the same step as other work.

The engine's outputs must not change with speculation: greedy and seeded outputs are
token-identical with and without it (whatever the drafts: all right, all wrong, or
mixed), under chunked prefill, prefix hits, preemption and async scheduling; unseeded
samples keep the target distribution (a chi-square test).

Most tests choose the drafts themselves (an oracle that proposes the true continuation,
or wrong tokens) by replacing the scheduler's proposer in this process: the model, the
worker and the verification are the real ones. The n-gram proposer itself is tested apart.
"""

from __future__ import annotations

import pytest

import pagoda.engine.core.scheduler as scheduler_module
from pagoda import LLM, SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.core.drafting import DraftTracker, propose_ngram
from pagoda.engine.speculative import SpeculativeConfig

PROMPTS = [list(range(100, 140)), [5, 6, 7, 8, 9, 10] * 5, [42, 17, 3000, 9]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=11, ignore_eos=True)
# Penalties and min_tokens count the drafts before each position as output. (Negative ones,
# which favour the tokens already out: a count missed changes the samples.)
PENALIZED = SamplingParams(max_tokens=24, temperature=1.5, seed=5, repetition_penalty=0.5, presence_penalty=-2.0,
                           frequency_penalty=-2.0, min_tokens=12)
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def test_ngram_proposer_takes_what_followed_the_latest_longest_match():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    # [1, 2, 3] occurs at 0 and 5: the latest is followed by 5, 6, 7.
    assert propose_ngram(tokens, 3, 2, 3) == [5, 6, 7]
    assert propose_ngram(tokens, 2, 2, 3) == [5, 6]
    assert propose_ngram([1, 2, 3, 1, 2], 4, 2, 4) == [3, 1, 2]  # up to the end of what is known
    assert propose_ngram([1, 2, 3, 4], 3, 2, 4) == []  # nothing repeats
    assert propose_ngram([7, 8, 9, 7], 3, 1, 1) == [8, 9, 7]  # n = 1
    assert propose_ngram([5], 3, 1, 3) == []


def test_a_request_that_keeps_rejecting_stops_proposing_for_a_while():
    config = SpeculativeConfig(num_speculative_tokens=2, window=2, min_acceptance=0.5)
    tracker = DraftTracker()
    tracker.record(2, 0, config)
    assert tracker.should_propose()
    tracker.record(2, 0, config)  # 0 of 4 accepted: a pause of 4 steps
    assert [tracker.should_propose() for _ in range(5)] == [False] * 4 + [True]
    tracker.record(2, 2, config)
    tracker.record(2, 2, config)  # all accepted: proposes every step
    assert tracker.should_propose()


def test_speculative_config_is_validated():
    assert EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}') \
        .speculative_config.num_speculative_tokens == 2
    for bad, words in [({"method": "eagle"}, "method"), ({"method": "draft_model"}, "needs 'model'"),
                       ({"method": "ngram", "model": "x"}, "for method 'draft_model'"),
                       ({"num_speculative_tokens": 0}, "positive"), ({"num_speculative_tokens": 17}, "at most 16"),
                       ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceed"), ({"k": 3}, "unknown keys"),
                       ("{not json", "JSON")]:
        with pytest.raises(ValueError, match=words):
            EngineConfig(speculative_config=bad)


@pytest.fixture()
def proposer(monkeypatch):
    """Replaces the n-gram proposer; returns a setter: ``set(fn)`` with fn(token_ids, k) -> drafts."""
    def install(fn):
        monkeypatch.setattr(scheduler_module, "propose_ngram", lambda token_ids, k, lo, hi: fn(token_ids, k))
    return install


def oracle(references: list[list[int]], wrong_after: int | None = None):
    """Proposes each request's true continuation (from a run without speculation); from the
    ``wrong_after``-th draft on, a wrong token instead."""
    def propose(token_ids, k):
        for full in references:
            n = len(token_ids)
            if full[:n] == token_ids:
                drafts = full[n:n + k]
                if wrong_after is not None:
                    drafts = [t if i < wrong_after else (t + 1) % 40000 for i, t in enumerate(drafts)]
                return drafts
        return []
    return propose


def references_of(model_dir, all_params, **options) -> dict[int, list[list[int]]]:
    """Outputs without speculation, by id of the parameters, from one engine."""
    with LLM(str(model_dir), dtype="float32", enforce_eager=True, **options) as llm:
        references = {}
        for params in all_params:
            llm.reset_prefix_cache()
            references[id(params)] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        return references


def generate(model_dir, params, speculative=None, **options):
    with LLM(str(model_dir), dtype="float32", enforce_eager=True, speculative_config=speculative, **options) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        stats = llm.engine.scheduler.stats
        kv = llm.engine.scheduler.kv_cache_manager
        kv.check_invariants()
        assert kv.get_num_free_blocks() == kv.num_blocks
        return outputs, stats


# NOTE: no plain setup apart: each of these runs the plain path too, and more.
SETUPS = {
    "chunked": dict(block_size=4, max_num_batched_tokens=8),
    "async": dict(async_scheduling=True),
    "preempted": dict(block_size=4, num_kv_blocks=30, max_model_len=64, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_greedy_and_seeded_outputs_do_not_change_with_speculation(tiny_llama_dir, proposer, setup):
    options = SETUPS[setup]
    references = references_of(tiny_llama_dir, (GREEDY, SEEDED, PENALIZED), **options)
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, speculative_config=SPEC, **options) as llm:
        stats, kv = llm.engine.scheduler.stats, llm.engine.scheduler.kv_cache_manager
        for drafts, wrong_after in (("right", None), ("wrong", 0), ("mixed", 1)):
            for params in (GREEDY, SEEDED, PENALIZED):
                reference = references[id(params)]
                proposer(oracle([p + o for p, o in zip(PROMPTS, reference)], wrong_after))
                llm.reset_prefix_cache()
                before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_steps,
                          stats.num_preemptions)
                got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
                assert got == reference, (drafts, params)
                num_drafts, draft_tokens, accepted, steps, preemptions = (
                    now - then for now, then in zip((stats.num_drafts, stats.num_draft_tokens,
                                                     stats.num_accepted_tokens, stats.num_steps,
                                                     stats.num_preemptions), before))
                assert num_drafts > 0
                if drafts == "right":
                    assert accepted == draft_tokens
                    assert steps < 20  # 24 tokens in far fewer steps
                elif drafts == "wrong":
                    assert accepted == 0
                else:
                    assert 0 < accepted < draft_tokens
                if setup == "preempted":
                    assert preemptions > 0
                kv.check_invariants()
                assert kv.get_num_free_blocks() == kv.num_blocks


def test_speculation_with_prefix_hits_and_logprobs(tiny_llama_dir, proposer):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True) as llm:
        reference = llm.generate(PROMPTS, params)
    proposer(oracle([p + o.outputs[0].token_ids for p, o in zip(PROMPTS, reference)], wrong_after=2))
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, speculative_config=SPEC) as llm:
        llm.generate(PROMPTS, params)
        again = llm.generate(PROMPTS, params)  # the prompts are in the prefix cache now
        assert again[0].metrics.num_cached_tokens > 0
        assert llm.engine.scheduler.stats.num_accepted_tokens > 0
    for ours, theirs in zip(again, reference):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert len(ours.outputs[0].logprobs) == 16
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert a.token_id == b.token_id and a.top_token_ids == b.top_token_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_drafts_stop_at_max_tokens_and_eos(tiny_llama_dir, proposer):
    # The drafts run past max_tokens and past a stop token: the output ends where it must.
    reference, _ = generate(tiny_llama_dir, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    full = [p + o for p, o in zip(PROMPTS, reference)]
    proposer(oracle(full))
    got, _ = generate(tiny_llama_dir, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), SPEC)
    assert got == [o[:10] for o in reference]
    stop = reference[0][6]
    got, _ = generate(tiny_llama_dir, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop]), SPEC)
    assert got[0] == reference[0][:reference[0].index(stop) + 1]


@pytest.mark.slow
def test_samples_keep_the_target_distribution(tiny_llama_dir, proposer):
    # The first output token comes from the prompt's step; drafts start after it. The
    # second and third tokens' distributions, over 400 samples, with and without drafts.
    scipy_stats = pytest.importorskip("scipy.stats")
    prompt = [100, 200, 300, 400]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, ignore_eos=True)
    num = 400
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, seed=1) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate([prompt] * num, params)]

    def likeliest(position):
        tokens = [t[position] for t in plain]
        return max(set(tokens), key=tokens.count)

    # The drafts are the likeliest tokens: accepted often, rejected often.
    drafts = [likeliest(1), likeliest(2)]
    proposer(lambda token_ids, k: drafts[:k] if len(token_ids) == len(prompt) + 1 else [])
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, seed=2,
             speculative_config={"method": "ngram", "num_speculative_tokens": 2}) as llm:
        spec = [o.outputs[0].token_ids for o in llm.generate([prompt] * num, params)]
        stats = llm.engine.scheduler.stats
    assert stats.num_drafts == num and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for position in (1, 2):
        a = [t[position] for t in plain]
        b = [t[position] for t in spec]
        tokens = sorted(set(a) | set(b))
        table = [[a.count(t) for t in tokens], [b.count(t) for t in tokens]]
        _, p_value, _, _ = scipy_stats.chi2_contingency(table)
        assert p_value > 1e-3, (position, table, p_value)


@pytest.mark.slow
def test_server_streams_speculated_tokens_and_exports_vllms_counters(tiny_llama_dir, proposer):
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from pagoda.server.testing import ServerThread, http_request

    prompt = PROMPTS[0]
    reference, _ = generate(tiny_llama_dir, GREEDY)
    proposer(oracle([p + o for p, o in zip(PROMPTS, reference)], wrong_after=2))
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=256,
                          num_kv_blocks=256, speculative_config=SPEC)
    with ServerThread(config) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                           logprobs=0, extra_body={"ignore_eos": True})
        streamed = [lp for chunk in stream for lp in (chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs
                                                       else [])]
        assert "".join(streamed) == server.engine.tokenizer.decode(reference[0])
        text = http_request(server.url + "/metrics").text
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    drafts = samples[("pagoda:spec_decode_num_draft_tokens_total", None)]
    accepted = samples[("pagoda:spec_decode_num_accepted_tokens_total", None)]
    assert samples[("pagoda:spec_decode_num_drafts_total", None)] > 0 and 0 < accepted < drafts
    per_position = [samples[("pagoda:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(3)]
    assert per_position[2] == 0 and sum(per_position) == accepted  # the third draft is always wrong


def test_the_command_line_flag():
    import argparse

    from pagoda.engine.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--speculative-config", '{"num_speculative_tokens": 2}']))
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    assert engine_config_from_args(parser.parse_args([])).speculative_config is None


def test_each_draft_position_counts_the_drafts_before_it_as_output():
    # The sampler's view of a speculating request, position by position: the penalties'
    # output counts and min_tokens take the drafts before each position as output.
    import numpy as np
    import torch

    from pagoda.engine.messages import NewRequestData
    from pagoda.engine.worker.input_batch import InputBatch

    vocab = 64
    batch = InputBatch(2, 32, 4, vocab, [2], torch.device("cpu"))
    params = SamplingParams(temperature=1.0, presence_penalty=1.0, min_tokens=4, stop_token_ids=[9])
    row = batch.add(NewRequestData("a", [5, 6, 7], [8, 8], params, [], 0))
    drafts = [11, 8, 12]
    batch.token_ids[row, 5:8] = drafts  # where the worker writes them, after the known tokens
    rows, offsets = np.array([row] * 4), np.arange(4)
    md = batch.sampling_metadata(rows, offsets)
    counts = md.output_counts
    expected = np.zeros((4, vocab))
    for position in range(4):
        for token in [8, 8, *drafts[:position]]:
            expected[position, token] += 1
    assert np.array_equal(counts.numpy(), expected)
    # Two outputs are known: positions 0 and 1 are short of min_tokens (4), 2 and 3 are not.
    suppressed = sorted(set(md.edit_rows.tolist()))
    assert suppressed == [0, 1]
    assert set(md.edit_token_ids.tolist()) == {2, 9} and set(md.edit_values.tolist()) == {float("-inf")}


# -- a draft model -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller model (one layer, other weights) with the same vocabulary: a real draft."""
    from conftest import TINY_INIT
    from helpers import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-draft"), "llama", seed=3, num_hidden_layers=1,
                               **TINY_INIT)


DRAFT_SETUPS = {
    "chunked": dict(block_size=4, max_num_batched_tokens=8),
    "async": dict(async_scheduling=True),
    "swapped": dict(block_size=4, num_kv_blocks=30, max_model_len=64, max_num_batched_tokens=16,
                    preemption_mode="swap"),
}


@pytest.mark.slow
@pytest.mark.parametrize("setup", sorted(DRAFT_SETUPS))
def test_a_draft_models_drafts_leave_outputs_unchanged(tiny_llama_dir, draft_dir, setup):
    options = DRAFT_SETUPS[setup]
    references = references_of(tiny_llama_dir, (GREEDY, SEEDED), **options)
    for draft, all_accepted in ((tiny_llama_dir, True), (draft_dir, False)):
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
        with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, speculative_config=spec, **options) as llm:
            stats, kv = llm.engine.scheduler.stats, llm.engine.scheduler.kv_cache_manager
            for params in (GREEDY, SEEDED):
                llm.reset_prefix_cache()
                before = stats.num_draft_tokens, stats.num_accepted_tokens
                got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
                assert got == references[id(params)], (draft, params)
                drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
                assert drafted > 0
                if all_accepted and params is GREEDY and setup != "swapped":
                    assert accepted == drafted  # the model drafting for itself, greedily
                kv.check_invariants()
                assert kv.get_num_free_blocks() == kv.num_blocks
            if setup == "swapped":
                assert stats.num_swapped_out > 0
            else:
                # Again, with the prompts in the prefix cache (both models' K/V in its blocks).
                got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
                assert got == references[id(GREEDY)]
                assert stats.prefix_cache_hits > 0


def test_a_draft_model_must_share_the_vocabulary(tiny_llama_dir, tmp_path):
    from conftest import TINY_INIT
    from helpers import make_tiny_model_dir

    other = make_tiny_model_dir(tmp_path / "other-vocab", "llama", vocab_size=1000, **TINY_INIT)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True,
            speculative_config={"method": "draft_model", "model": str(other)})


@pytest.mark.slow
def test_drafts_near_the_end_of_the_context(tiny_llama_dir, draft_dir):
    # Requests that run into max_model_len: neither drafts nor the draft model's slots
    # ever pass it.
    prompts = [list(range(100, 100 + n)) for n in (20, 27, 30)]
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=32, block_size=4) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for spec in ({"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 5},
                 {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 5}):
        with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=32, block_size=4,
                 speculative_config=spec) as llm:
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
            assert llm.engine.scheduler.stats.num_draft_tokens > 0


def test_the_samples_of_an_n_request_speculate_apart(tiny_llama_dir, proposer):
    params = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=4, ignore_eos=True)
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True) as llm:
        reference = [[s.token_ids for s in o.outputs] for o in llm.generate(PROMPTS[:2], params)]
    proposer(oracle([p + sample for p, samples in zip(PROMPTS, reference) for sample in samples], wrong_after=2))
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, speculative_config=SPEC) as llm:
        got = [[s.token_ids for s in o.outputs] for o in llm.generate(PROMPTS[:2], params)]
        assert llm.engine.scheduler.stats.num_accepted_tokens > 0
    assert got == reference


def test_a_stop_string_inside_accepted_drafts_ends_the_output_there(tiny_llama_dir, proposer):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True) as llm:
        reference = llm.generate(PROMPTS[:1], params)[0].outputs[0]
        stop = llm.tokenizer.decode(reference.token_ids[9:11])  # ends inside a run of drafts below
        stopped = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                            stop=[stop], logprobs=0))[0].outputs[0]
    proposer(oracle([PROMPTS[0] + reference.token_ids]))
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, speculative_config=SPEC) as llm:
        got = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                                                        logprobs=0))[0].outputs[0]
        assert llm.engine.scheduler.stats.num_accepted_tokens > 0
    assert got.text == stopped.text and got.token_ids == stopped.token_ids and got.finish_reason == "stop"
    assert [e.token_id for e in got.logprobs] == stopped.token_ids
