"""batch_invariant: bfloat16 outputs identical whatever a request is batched with, however its
prompt is chunked or found in the prefix cache, with n-gram speculation, and after it is
preempted and recomputed (as after a worker restart: tests/test_server_faults.py kills one).

The matrix: 16 requests (greedy and seeded, alternately), each cell equal to the same request
run alone, its tokens and their logprobs to the last bit: in batches of 7 and of 64, after a prefix-cache hit, under chunked prefill
with preemption by recompute, and with n-gram speculation; on a tiny model and on the default
model, on every invariant path of the kernel this machine has.
"""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.models.linear import BLOCKED_LAYOUT, PACKING_ENV, packing_available

pytestmark = pytest.mark.skipif(not packing_available("blocked"),
                                reason="batch invariance needs Pagoda's blocked kernel (AVX512-BF16)")

rng = random.Random(0)


def _prompt() -> list[int]:
    # NOTE: a repeated phrase in each, so that n-gram speculation finds drafts.
    phrase = [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 8))]
    return [rng.randrange(100, 40000) for _ in range(rng.randrange(5, 40))] + phrase * rng.randrange(2, 6)


PROMPTS = [_prompt() for _ in range(16)]
FILLERS = [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 120))] for _ in range(48)]
# Greedy and seeded sampling, alternately.
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0) if i % 2 == 0 else
          SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True, logprobs=0) for i in range(16)]
FILLER_PARAMS = SamplingParams(temperature=1.0, seed=99, max_tokens=30, ignore_eos=True)
OPTIONS = dict(dtype="bfloat16", batch_invariant=True, max_model_len=256)


def tokens(outputs) -> list[tuple]:
    """Each request's tokens and their logprobs: equal means equal to the last bit."""
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs or []]) for o in outputs]


def run_matrix(model: str, speculative: dict, **engine) -> dict[str, list[tuple]]:
    """The 16 requests' tokens in every cell of the matrix, and alone (``engine``: more of the
    engine's options)."""
    cells = {}
    options = {**OPTIONS, **engine}
    with LLM(model, **options) as llm:
        cells["alone"] = [tokens(llm.generate([p], [sp]))[0] for p, sp in zip(PROMPTS, PARAMS)]
        # Every prompt is cached now: run again, each prompt's tail is computed on its own.
        hits = llm.generate(PROMPTS, PARAMS)
        assert all(o.metrics.num_cached_tokens > 0 for o in hits if len(o.prompt_token_ids) > 32)
        cells["after a prefix-cache hit"] = tokens(hits)
        llm.engine.reset_prefix_cache()
        cells["in batches of 7"] = sum((tokens(llm.generate(PROMPTS[i:i + 7], PARAMS[i:i + 7]))
                                        for i in range(0, 16, 7)), [])
        cells["in a batch of 64"] = tokens(llm.generate(FILLERS[:24] + PROMPTS + FILLERS[24:],
                                                        [FILLER_PARAMS] * 24 + PARAMS + [FILLER_PARAMS] * 24))[24:40]
    # Too few blocks for everyone and prompts chunked: requests are preempted and their tokens
    # recomputed in a prefill, as a worker restart recomputes them.
    with LLM(model, num_kv_blocks=24, block_size=16, preemption_mode="recompute", max_num_batched_tokens=48,
             **options) as llm:
        cells["chunked and preempted"] = tokens(llm.generate(FILLERS[:12] + PROMPTS,
                                                             [FILLER_PARAMS] * 12 + PARAMS))[12:]
        assert llm.engine.scheduler.stats.num_recomputed > 0
    # NOTE: verification runs a request's drafts and the token after them as rows of one product.
    with LLM(model, speculative_config=speculative, **options) as llm:
        cells[f"with {speculative['method']} speculation"] = tokens(llm.generate(PROMPTS, PARAMS))
        assert llm.engine.scheduler.stats.num_accepted_tokens > 0
    return cells


def assert_every_cell_equal(cells: dict[str, list[tuple]]) -> None:
    alone = cells.pop("alone")
    differing = {name: [i for i, (a, b) in enumerate(zip(alone, got)) if a != b] for name, got in cells.items()}
    assert not any(differing.values()), {name: rows for name, rows in differing.items() if rows}


# NOTE: both invariant paths of the kernel where the machine has them: AMX tiles for every row
# (Intel from Sapphire Rapids), AVX512-BF16 vectors (everywhere the kernel runs).
@pytest.mark.slow
@pytest.mark.parametrize("packing", [packing for packing in BLOCKED_LAYOUT if packing_available(packing)])
def test_tiny_model_outputs_are_the_same_in_every_cell(tiny_llama_dir, packing, monkeypatch):
    monkeypatch.setenv(PACKING_ENV, packing)
    # NOTE: a random model's text seldom repeats its prompt, so prompt lookup would find no
    # drafts: the model drafts for itself (greedily; most drafts are then accepted).
    model = str(tiny_llama_dir)
    assert_every_cell_equal(run_matrix(model, {"method": "draft_model", "model": model, "num_speculative_tokens": 3}))


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_tiny_mixture_of_experts_outputs_are_the_same_in_every_cell(tmp_path, quantization):
    """A mixture of experts (Qwen3-MoE's layers, 4 experts, 2 a token): each token's experts and
    their sums do not depend on the other tokens of the step, in bfloat16 (the packed kernel) and
    int8 (every expert's products in one parallel region) alike."""
    from conftest import TINY_INIT
    from helpers import make_tiny_model_dir

    model = str(make_tiny_model_dir(tmp_path, "qwen3_moe", seed=6, moe_intermediate_size=64, **TINY_INIT))
    assert_every_cell_equal(run_matrix(model, {"method": "draft_model", "model": model, "num_speculative_tokens": 3},
                                       quantization=quantization))


@pytest.mark.slow
def test_default_model_outputs_are_the_same_in_every_cell():
    from pagoda.engine.model_loader import resolve_model

    assert_every_cell_equal(run_matrix(str(resolve_model(None)), {"method": "ngram", "num_speculative_tokens": 3}))


def test_batch_invariance_refuses_what_it_cannot_keep(tiny_llama_dir):
    with pytest.raises(Exception, match="batch_invariant needs bfloat16"):
        LLM(str(tiny_llama_dir), dtype="float32", batch_invariant=True, max_model_len=128)
    with pytest.raises(Exception, match="cpu_paged"):
        LLM(str(tiny_llama_dir), dtype="bfloat16", batch_invariant=True, attention_backend="naive",
            max_model_len=128)


def test_invariance_is_the_default_where_it_costs_little(tiny_llama_dir, monkeypatch):
    """batch_invariant None (the default) is on where the default path's products already sum
    every row alike (Pagoda's AVX512-BF16 kernel without AMX tiles: the "blocked" packing) and
    nothing else would be lost, off elsewhere; a live engine says which it runs, and where on,
    a prompt found in the prefix cache gives the tokens and logprobs it gave when computed."""
    import dataclasses

    import torch

    from pagoda.engine.config import EngineConfig
    from pagoda.engine.model_config import ModelConfig
    from pagoda.engine.models.linear import choose_packing
    from pagoda.engine.frontend.start_plan import resolve_batch_invariant

    cpu, llama = torch.device("cpu"), ModelConfig.from_dir(tiny_llama_dir)

    def resolve(config=EngineConfig(), dtype=torch.bfloat16, fp8=None, model=llama, backend="cpu_paged", ranks=1):
        return resolve_batch_invariant(config, cpu, dtype, fp8, model, backend, ranks)

    monkeypatch.delenv(PACKING_ENV, raising=False)
    default = choose_packing(cpu, torch.bfloat16) == "blocked"
    assert resolve() == default
    assert resolve(EngineConfig(batch_invariant=True)) and not resolve(EngineConfig(batch_invariant=False))
    monkeypatch.setenv(PACKING_ENV, "blocked")  # the kernel an AMD Zen 4 runs, forced on any CPU that has it
    assert resolve()
    # Not where it would cost or cannot hold: float32, another backend, an fp8 cache, adapters,
    # several ranks, a family whose steps run layer by layer (compiled, else eager).
    assert not resolve(dtype=torch.float32)
    assert not resolve(backend="naive")
    assert not resolve(fp8=torch.float8_e4m3fn)
    assert not resolve(EngineConfig(enable_lora=True))
    assert not resolve(ranks=2)
    assert not resolve(model=dataclasses.replace(llama, sandwich_norms=True))  # Gemma's
    assert resolve(model=dataclasses.replace(llama, qk_norm=True))  # Qwen3's steps run in one call
    # and so do a mixture of experts' (Qwen3-MoE's, Mixtral's)
    assert resolve(model=dataclasses.replace(llama, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64))
    if packing_available("onednn"):
        monkeypatch.setenv(PACKING_ENV, "onednn")  # products of few rows round apart from many
        assert not resolve()
    monkeypatch.delenv(PACKING_ENV)
    with LLM(str(tiny_llama_dir), dtype="bfloat16", max_model_len=256) as llm:
        assert llm.engine.worker.ready.batch_invariant == default
        assert ("batch-invariant" in llm.engine.describe()) == default
        if default:
            computed = tokens(llm.generate(PROMPTS[:8], PARAMS[:8]))
            cached = llm.generate(PROMPTS[:8], PARAMS[:8])
            assert all(o.metrics.num_cached_tokens > 0 for o in cached if len(o.prompt_token_ids) > 32)
            assert tokens(cached) == computed
