"""batch_invariant: bfloat16 outputs identical whatever a request is batched with, however its
prompt is chunked, and after it is preempted and recomputed (as after a worker restart)."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.models.linear import BLOCKED_LAYOUT, PACKING_ENV, packing_available

pytestmark = pytest.mark.skipif(not packing_available("blocked"),
                                reason="batch invariance needs Pagoda's blocked kernel (AVX512-BF16)")

rng = random.Random(0)
PROMPTS = [[rng.randrange(100, 40000) for _ in range(rng.randrange(5, 90))] for _ in range(16)]
FILLERS = [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 120))] for _ in range(24)]
# Greedy and seeded sampling, alternately.
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) if i % 2 == 0 else
          SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) for i in range(16)]
FILLER_PARAMS = SamplingParams(temperature=1.0, seed=99, max_tokens=30, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# NOTE: both invariant paths of the kernel where the machine has them: AMX tiles for every row
# (Intel from Sapphire Rapids), AVX512-BF16 vectors (everywhere the kernel runs).
@pytest.mark.parametrize("packing", [packing for packing in BLOCKED_LAYOUT if packing_available(packing)])
def test_outputs_do_not_depend_on_the_batch_chunking_or_preemption(tiny_llama_dir, packing, monkeypatch):
    monkeypatch.setenv(PACKING_ENV, packing)
    options = dict(dtype="bfloat16", batch_invariant=True, max_model_len=256, max_num_batched_tokens=48)
    with LLM(str(tiny_llama_dir), **options) as llm:
        alone = [tokens(llm.generate([p], [sp]))[0] for p, sp in zip(PROMPTS, PARAMS)]
        together = tokens(llm.generate(PROMPTS, PARAMS))
        mixed = tokens(llm.generate(FILLERS[:12] + PROMPTS + FILLERS[12:],
                                    [FILLER_PARAMS] * 12 + PARAMS + [FILLER_PARAMS] * 12))[12:28]
    assert sum(a == b for a, b in zip(alone, together)) == 16
    assert sum(a == b for a, b in zip(alone, mixed)) == 16
    # Too few blocks for everyone: requests are preempted and their tokens recomputed in a
    # prefill, as a worker restart recomputes them.
    with LLM(str(tiny_llama_dir), num_kv_blocks=24, block_size=16, preemption_mode="recompute", **options) as llm:
        crowded = tokens(llm.generate(FILLERS[:12] + PROMPTS, [FILLER_PARAMS] * 12 + PARAMS))[12:]
        assert llm.engine.scheduler.stats.num_recomputed > 0
    assert sum(a == b for a, b in zip(alone, crowded)) == 16


def test_batch_invariance_refuses_what_it_cannot_keep(tiny_llama_dir):
    with pytest.raises(Exception, match="batch_invariant needs bfloat16"):
        LLM(str(tiny_llama_dir), dtype="float32", batch_invariant=True, max_model_len=128)
    with pytest.raises(Exception, match="cpu_paged"):
        LLM(str(tiny_llama_dir), dtype="bfloat16", batch_invariant=True, attention_backend="naive",
            max_model_len=128)
