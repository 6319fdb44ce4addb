"""The structured-output mechanism without the default model: the worker's logits mask and
a tiny random model held to its grammar (whatever the weights, the output must match)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.engine.core.request import RequestStatus
from pagoda.engine.sampling_params import StructuredOutputsParams
from pagoda.engine.worker.model_runner import _mask_logits


def test_mask_sets_exactly_the_disallowed_tokens_to_minus_inf():
    rng = np.random.default_rng(0)
    logits = torch.randn(10, 100)
    reference = logits.clone()
    bitmask = rng.integers(-2**31, 2**31 - 1, size=(4, 4), dtype=np.int32)
    grammar_rows, sample_rows = [7, 2, 9, 4], np.array([5, 7, 1, 2, 3, 4, 9, 8, 6, 0])
    _mask_logits(logits, sample_rows, grammar_rows, bitmask)
    for j, row in enumerate(grammar_rows):
        i = list(sample_rows).index(row)
        expected = reference[i].clone()
        for token in range(100):
            if not (int(bitmask[j][token // 32]) >> (token % 32)) & 1:
                expected[token] = float("-inf")
        assert torch.equal(logits[i], expected)
    untouched = [i for i, row in enumerate(sample_rows) if row not in grammar_rows]
    assert torch.equal(logits[untouched], reference[untouched])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_random_model_follows_regex_choice_and_schema(tiny_llama_dir, async_scheduling):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False,
              # NOTE: no free whitespace, or a random model may write blanks until max_tokens.
              "x-guidance": {"whitespace_flexible": False}}
    cases = [(StructuredOutputsParams(regex=r"[a-c]{2,4}"), lambda t: re.fullmatch(r"[a-c]{2,4}", t)),
             (StructuredOutputsParams(choice=["alpha", "beta"]), lambda t: t in ("alpha", "beta")),
             (StructuredOutputsParams(json=schema), lambda t: set(json.loads(t)) == {"ok", "n"})]
    with LLM(str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=256,
             async_scheduling=async_scheduling) as llm:
        # NOTE: unconstrained requests in the same steps, and n = 2 forks of each.
        plain = SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True)
        params = [SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=60, structured_outputs=c) for c, _ in cases]
        outputs = llm.generate(["Hello"] * 4, [*params, plain])
        for (_, check), out in zip(cases, outputs):
            for sample in out.outputs:
                assert sample.finish_reason == "stop" and check(sample.text), sample
        assert len(outputs[-1].outputs[0].token_ids) == 30
        kv = llm.engine.scheduler.kv_cache_manager
        assert kv.get_num_free_blocks() == kv.num_blocks


def test_a_grammar_waits_for_the_end_of_thinking(tiny_llama_dir):
    """The scheduler sends no mask and feeds the matcher nothing until the closing tag's
    tokens are out; from the next token on, the grammar applies."""
    from transformers import AutoTokenizer

    from pagoda.engine.core.grammar import BitmaskFiller, GrammarCompiler
    from pagoda.engine.core.kv_cache_manager import KVCacheManager
    from pagoda.engine.core.request import Request
    from pagoda.engine.core.scheduler import Scheduler
    from pagoda.engine.messages import RunnerOutput

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, [2])
    scheduler = Scheduler(KVCacheManager(32, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                          bitmasks=BitmaskFiller(tokenizer.vocab_size))
    request = Request("a", [5, 6, 7], SamplingParams(max_tokens=20), max_tokens=20, eos_token_ids=frozenset({2}))
    request.matcher = compiler.matchers(StructuredOutputsParams(choice=["yes", "no"]), 1)[0]
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    request.reasoning_end = end
    scheduler.add_request(request)
    thinking = [*tokenizer.encode("Let me think", add_special_tokens=False), *end]
    for token in thinking:
        out = scheduler.schedule()
        assert out.grammar_request_ids == []  # thinking is free text
        scheduler.update(out, RunnerOutput(step_id=out.step_id, sampled={"a": token}))
    assert request.reasoning_end is None and request.status == RequestStatus.RUNNING
    out = scheduler.schedule()
    assert out.grammar_request_ids == ["a"]
    allowed = [t for t in range(tokenizer.vocab_size) if (int(out.grammar_bitmask[0][t // 32]) >> (t % 32)) & 1]
    assert {tokenizer.decode([t]) for t in allowed} <= {"y", "ye", "yes", "n", "no"}


@pytest.mark.parametrize("prompt_tags, constrained", [("<think>", False), ("<think>Easy.</think>", True)])
def test_the_offline_engine_applies_a_grammar_after_the_prompts_thinking(tiny_llama_dir, prompt_tags, constrained):
    with LLM(str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=256,
             reasoning_parser="deepseek_r1") as llm:
        ids = llm.tokenizer.encode("Answer:", add_special_tokens=False)
        ids += llm.tokenizer.encode(prompt_tags, add_special_tokens=False)
        params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(
            choice=["alpha", "beta"]))
        sample = llm.generate([ids], params)[0].outputs[0]
    if constrained:  # the prompt closed the thinking: the answer is held to the grammar
        assert sample.text in ("alpha", "beta") and sample.finish_reason == "stop"
    else:  # still thinking, and a random model never writes </think>: free text to the end
        assert sample.finish_reason == "length" and sample.text not in ("alpha", "beta")
