"""Tests for engine/worker/sampler.py (CPU, no model)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import sampling_metadata
from pagoda.engine.worker.sampler import Sampler, _apply_penalties
from pagoda.engine.sampling_params import SamplingParams

EOS = 2


def sample(logits, params, outputs=None, prompts=None, sampler=None, eos=(EOS,)):
    """Builds metadata for ``params`` and samples once."""
    n = len(params)
    md = sampling_metadata(
        params,
        prompts if prompts is not None else [[]] * n,
        outputs if outputs is not None else [[]] * n,
        list(eos),
        logits.shape[1],
    )
    return (sampler or Sampler(seed=0))(logits, md)


def test_greedy_is_argmax_and_fast_path_builds_nothing():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0)] * 6
    md = sampling_metadata(params, [[1]] * 6, [[2]] * 6, [EOS], 50)
    assert md.all_greedy and not md.all_random
    assert md.temperature is None and md.repetition_penalties is None and md.edit_rows is None and md.allowed_rows is None
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None
    # Any float dtype is accepted.
    half = logits.to(torch.bfloat16)
    assert torch.equal(sample(half, params).sampled_token_ids, half.float().argmax(-1))


@pytest.mark.parametrize("params, plain", [
    (SamplingParams(temperature=0), True),
    (SamplingParams(temperature=0, top_k=5, top_p=0.5), True),  # filters that greedy ignores
    (SamplingParams(temperature=0, logprobs=1), False),
    (SamplingParams(temperature=0, repetition_penalty=1.2), False),
    (SamplingParams(temperature=0, presence_penalty=0.5), False),
    (SamplingParams(temperature=0, min_tokens=3), False),
    (SamplingParams(temperature=0.8), False),
])
def test_plain_greedy_is_greedy_with_nothing_else_reading_the_logits(params, plain):
    """Sampler.plain_greedy: where the worker may let the LM head's kernel pick the tokens
    (without logits); one row that needs more than the largest logit turns it off for all."""
    md = sampling_metadata([SamplingParams(temperature=0), params], [[1], [1]], [[]] * 2, [EOS], 50)
    assert Sampler.plain_greedy(md) == plain


def test_mixed_greedy_and_random_rows():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 30, generator=gen)
    params = [SamplingParams(temperature=0 if i % 2 == 0 else 1.0, top_k=3 if i % 2 else 0) for i in range(8)]
    md = sampling_metadata(params, [[]] * 8, [[]] * 8, [EOS], 30)
    assert not md.all_greedy and not md.all_random and md.greedy_mask is not None
    before = logits.clone()
    for seed in range(20):
        out = Sampler(seed=seed)(logits, md).sampled_token_ids
        assert torch.equal(out[0::2], logits[0::2].argmax(-1))
        top3 = logits[1::2].topk(3).indices
        assert (top3 == out[1::2].unsqueeze(1)).any(1).all()
    assert torch.equal(logits, before), "the sampler must not modify its input"


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(temperature=1e-6)])
def test_filters_that_reduce_to_greedy(params):
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(3)) * 3
    for seed in range(10):
        out = sample(logits, [params] * 16, sampler=Sampler(seed=seed))
        assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_top_k_top_p_and_min_p_support():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().expand(4000, 5).contiguous()
    cases = {
        (2, 1.0, 0.0): {0, 1},
        (0, 0.6, 0.0): {0, 1},  # 0.4 < 0.6 <= 0.4 + 0.3
        (0, 1.0, 0.5): {0, 1},  # keep p >= 0.5 * 0.4
        (0, 1.0, 0.3): {0, 1, 2},
        (4, 0.8, 0.0): {0, 1, 2},  # top-k, then top-p on the renormalised top-4
        (0, 1.0, 0.0): {0, 1, 2, 3, 4},
    }
    for (k, p, mp), allowed in cases.items():
        params = SamplingParams(top_k=k, top_p=p, min_p=mp)
        got = set(sample(logits, [params] * 4000).sampled_token_ids.tolist())
        assert got == allowed, (k, p, mp, got)


def test_seeded_rows_do_not_depend_on_batch():
    gen = torch.Generator().manual_seed(4)
    target = torch.randn(1, 64, generator=gen)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    for step in range(5):
        out = [[7] * step]
        alone = sample(target, [params], outputs=out, sampler=Sampler(seed=1)).sampled_token_ids[0]
        others = torch.randn(5, 64, generator=gen)
        batch = torch.cat([others[:3], target, others[3:]])
        mixed = [
            SamplingParams(temperature=0),
            SamplingParams(top_k=5, seed=99),
            SamplingParams(min_p=0.2, repetition_penalty=1.3),
            params,
            SamplingParams(temperature=1.5),
            SamplingParams(seed=1234, temperature=0.5),
        ]
        outs = [[1]] * 3 + out + [[3, 4]] * 2
        res = sample(batch, mixed, outputs=outs, prompts=[[5, 6]] * 6, sampler=Sampler(seed=2)).sampled_token_ids
        assert res[3] == alone, step


def test_seeded_noise_changes_with_output_length():
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(seed=7)]
    tokens = {int(sample(logits, params, outputs=[[0] * i]).sampled_token_ids[0]) for i in range(20)}
    assert len(tokens) > 10  # uniform over 1000 tokens: repeats would mean reused noise
    again = {int(sample(logits, params, outputs=[[0] * i]).sampled_token_ids[0]) for i in range(20)}
    assert tokens == again


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# NOTE: 99.9% quantile of chi-square with 4 degrees of freedom; the draws are seeded, so
# the test is deterministic.
_CHI2_DF4_999 = 18.47


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_distribution_unseeded_rows(temperature):
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3])
    n = 20000
    out = sample(logits.expand(n, 5).contiguous(), [SamplingParams(temperature=temperature)] * n, sampler=Sampler(seed=5))
    counts = torch.bincount(out.sampled_token_ids, minlength=5).float()
    assert _chi_square(counts, (logits / temperature).softmax(-1)) < _CHI2_DF4_999


def test_distribution_seeded_rows():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3])
    n = 5000
    params = [SamplingParams(seed=s) for s in range(n)]
    out = sample(logits.expand(n, 5).contiguous(), params)
    counts = torch.bincount(out.sampled_token_ids, minlength=5).float()
    assert _chi_square(counts, logits.softmax(-1)) < _CHI2_DF4_999
    # One seed across many steps is a fair sampler too.
    steps = [int(sample(logits[None], [SamplingParams(seed=42)], outputs=[[0] * i]).sampled_token_ids[0]) for i in range(3000)]
    counts = torch.bincount(torch.tensor(steps), minlength=5).float()
    assert _chi_square(counts, logits.softmax(-1)) < _CHI2_DF4_999


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)]
    md = sampling_metadata(params, [[0, 0]], [[1, 3, 3]], [EOS], 6)
    got = logits.clone()
    _apply_penalties(got, md)
    # token 0: prompt only, positive -> /2; token 1: output once, negative -> *2, -0.25 -0.5;
    # token 3: output twice, positive -> /2, -0.5 -0.5; others untouched.
    expected = torch.tensor([[1.0, -2.75, 0.5, 0.5, -2.0, 1.0]])
    assert torch.allclose(got, expected)


def test_presence_frequency_without_repetition_skip_prompt():
    params = [SamplingParams(presence_penalty=-1.0, frequency_penalty=1.0), SamplingParams()]
    md = sampling_metadata(params, [[0], [0]], [[2, 2, 2], [2]], [EOS], 4)
    assert md.prompt_mask is None and md.output_counts is not None
    logits = torch.zeros(2, 4)
    _apply_penalties(logits, md)
    assert torch.allclose(logits, torch.tensor([[0.0, 0.0, -2.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    plain = SamplingParams(temperature=0)
    penalized = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, [plain], prompts=[[0]]).sampled_token_ids.item() == 0
    assert sample(logits, [penalized], prompts=[[0]]).sampled_token_ids.item() == 1


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.0, 4.0, 0.0]])  # EOS=2 best, then stop id 4, then 1
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4])
    picks = [sample(logits, [params], outputs=[[1] * i]).sampled_token_ids.item() for i in range(5)]
    assert picks == [1, 1, 1, 2, 2]
    ignore = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4], ignore_eos=True)
    assert sample(logits, [ignore], outputs=[[]]).sampled_token_ids.item() == 2
    # Random rows are blocked too, whatever the noise.
    rnd = SamplingParams(min_tokens=1, stop_token_ids=[4])
    out = sample(logits.expand(500, 6).contiguous(), [rnd] * 500, outputs=[[]] * 500).sampled_token_ids
    assert not ((out == 2) | (out == 4)).any()


def test_logprobs_are_raw_and_sorted():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 40, generator=gen)
    params = [
        SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, logprobs=5, min_tokens=2),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(logprobs=0, presence_penalty=1.0),
    ]
    out = sample(logits, params, outputs=[[1, 2], [3], [4], [5]], prompts=[[6]] * 4)
    assert out.logprobs.shape == (4, 6) and out.logprob_token_ids.shape == (4, 6)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    raw = logits.log_softmax(-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(out.logprobs, raw.gather(1, out.logprob_token_ids))
    top = out.logprobs[:, 1:]
    assert (top[:, :-1] >= top[:, 1:]).all()
    assert torch.equal(out.logprob_token_ids[:, 1:], raw.topk(5).indices)
    only_sampled = sample(logits, [SamplingParams(temperature=0, logprobs=0)] * 4)
    assert only_sampled.logprobs.shape == (4, 1)
    assert torch.allclose(only_sampled.logprobs[:, 0], raw.max(-1).values)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_reqs=st.integers(1, 6),
    vocab=st.integers(2, 40),
)
def test_property_sampled_tokens_respect_filters(data, num_reqs, vocab):
    logits = torch.tensor(data.draw(st.lists(st.floats(-20, 20), min_size=num_reqs * vocab, max_size=num_reqs * vocab))).view(num_reqs, vocab)
    params = [
        SamplingParams(
            temperature=data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
            top_k=data.draw(st.integers(0, vocab)),
            top_p=data.draw(st.sampled_from([1.0, 0.9, 0.5, 0.1])),
            min_p=data.draw(st.sampled_from([0.0, 0.1, 0.5])),
            seed=data.draw(st.one_of(st.none(), st.integers(-(2**63), 2**64))),
            logprobs=data.draw(st.one_of(st.none(), st.integers(0, min(5, vocab)))),
        )
        for _ in range(num_reqs)
    ]
    out = sample(logits, params, sampler=Sampler(seed=data.draw(st.integers(0, 100))))
    ids = out.sampled_token_ids
    assert ids.shape == (num_reqs,) and ids.dtype == torch.int64
    for row, p in enumerate(params):
        tok = int(ids[row])
        if p.temperature == 0:
            assert tok == int(logits[row].argmax())
            continue
        scaled = logits[row] / p.temperature
        if p.top_k:
            # NOTE: top-k filters the scaled logits, where the division may have merged two
            # (a denormal halved is 0): ties at the k-th value stay.
            assert scaled[tok] >= scaled.topk(p.top_k).values[-1]
        probs = scaled.softmax(-1)
        # min_p is relative to the top token: the sampled one is never far below it.
        assert probs[tok] >= probs.max() * p.min_p * (1 - 1e-4)
    if any(p.logprobs is not None for p in params):
        assert torch.allclose(out.logprobs[:, 0], logits.log_softmax(-1).gather(1, ids[:, None])[:, 0])
        assert not math.isnan(float(out.logprobs.sum()))


def test_bfloat16_ties_at_the_top_are_broken_by_the_float32_sums():
    from pagoda.engine.models.decoder import break_bfloat16_ties

    torch.manual_seed(0)
    vocab, size = 4000, 64
    hidden = torch.randn(5, size).to(torch.bfloat16)
    weight = torch.randn(vocab, size).to(torch.bfloat16)
    for row in range(5):  # token 10 row is each row's clear favourite ...
        weight[10 * row + 10] = hidden[row] * 2
    for row in range(4):  # ... and token 10 row + 11 a rival a hair below it in float32
        best, rival = 10 * row + 10, 10 * row + 11
        weight[rival] = weight[best]
        j = int(hidden[row].float().abs().argmax())
        nudge = torch.tensor(abs(float(weight[best, j])) * 2**-7 * (1 if hidden[row, j] < 0 else -1))
        weight[rival, j] = (weight[best, j].float() + nudge).to(torch.bfloat16)
    exact = hidden.float() @ weight.float().T  # what a float32 accumulator holds
    logits = exact.to(torch.bfloat16)
    for row in range(4):
        best, rival = 10 * row + 10, 10 * row + 11
        assert exact[row, best] > exact[row, rival]
        # as a bfloat16 kernel may write them: tied, or the rival a step above
        logits[row, rival] = logits[row, best] if row % 2 else torch.nextafter(
            logits[row, best].float(), torch.tensor(1e9)).to(torch.bfloat16)
        logits[row, rival] = max(logits[row, rival], logits[row, best])
    refined = break_bfloat16_ties(logits, hidden, weight, torch.tensor([0, 1, 2, 4]))  # row 3 samples
    assert refined.dtype == torch.float32
    for row in (0, 1, 2):
        best, rival = 10 * row + 10, 10 * row + 11
        assert int(refined[row].argmax()) == best == int(exact[row].argmax())
        assert float(refined[row, best]) == pytest.approx(float(exact[row, best]), rel=1e-6)
        assert float(refined[row, rival]) == pytest.approx(float(exact[row, rival]), rel=1e-6)
        changed = refined[row] != logits[row].float()
        assert set(changed.nonzero().squeeze(1).tolist()) <= {best, rival}  # only the candidates
    # a sampled row and a row without a tie: their bfloat16 values, in float32
    assert torch.equal(refined[3:], logits[3:].float())
