"""Code ported from vLLM's offline API runs unchanged: ``LLM.get_tokenizer()``, logprobs read as
vLLM's ``{token_id: Logprob}`` (Pagoda's TokenLogprobs stays reachable, as the same objects),
``SamplingParams(logit_bias=..., allowed_token_ids=..., bad_words=...)``, and ``logit_bias``
over HTTP. The sampler's edits are checked against the plain greedy path on the same logits."""

from __future__ import annotations

import math

import openai
import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.messages import TokenLogprobs
from pagoda.server.testing import ServerThread

PROMPTS = ["Hello, my name is", "The capital of France is"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=128, num_kv_blocks=64) as llm:
        yield llm


def vllm_example(llm) -> list[tuple[str, str, list[tuple[float, int | None]]]]:
    """vLLM's offline example, as its users write it."""
    tokenizer = llm.get_tokenizer()
    sampling_params = SamplingParams(temperature=0, max_tokens=8, logprobs=3)
    outputs = llm.generate(PROMPTS, sampling_params)
    results = []
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        seen = []
        for token_id, logprob_dict in zip(output.outputs[0].token_ids, output.outputs[0].logprobs):
            assert token_id in logprob_dict and len(logprob_dict) >= 3
            entry = logprob_dict[token_id]
            seen.append((entry.logprob, entry.rank))
            best = max(logprob_dict.items(), key=lambda item: item[1].logprob)
            assert best[1].rank == 1 and best[1].decoded_token == tokenizer.decode([best[0]])
        results.append((prompt, generated_text, seen))
    return results


def test_vllms_offline_example_runs_unchanged(llm):
    results = vllm_example(llm)
    assert [prompt for prompt, _, _ in results] == PROMPTS
    for _, text, seen in results:
        assert text and len(seen) == 8
        assert all(rank == 1 for _, rank in seen)  # greedy: the sampled token is the likeliest
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2, logprobs=2))[0].outputs[0]
    assert isinstance(out.logprobs[0], TokenLogprobs)  # Pagoda's own object, the same entries
    assert out.logprobs[0][out.token_ids[0]].logprob == out.logprobs[0].logprob


def test_logit_bias_allowed_token_ids_and_bad_words_steer_greedy_decoding(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(PROMPTS[:1], greedy)[0].outputs[0].token_ids
    forced = 1234
    biased = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                      logit_bias={forced: 100}))[0].outputs[0].token_ids
    assert biased == [forced] * 6
    banned = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                      logit_bias={str(plain[0]): -100}))[0].outputs[0].token_ids
    assert banned[0] != plain[0]
    allowed = [5, 77, 901]
    limited = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.9, seed=1, max_tokens=12, ignore_eos=True,
                                                       allowed_token_ids=allowed))[0].outputs[0].token_ids
    assert set(limited) <= set(allowed)
    # A bad word of one token is never generated; the word that greedy decoding wrote first is
    # gone, and what differs starts where it stood.
    tokenizer = llm.get_tokenizer()
    word = tokenizer.decode([plain[0]])
    without = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                       bad_words=[word]))[0].outputs[0].token_ids
    words = llm.engine._bad_words_token_ids([word])
    single = {ids[0] for ids in words if len(ids) == 1}
    assert plain[0] in single and not single & set(without)
    # Requests without edits beside ones with them are the plain greedy path's, token for token.
    mixed = llm.generate(PROMPTS[:1] * 2, [greedy, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                   logit_bias={forced: 100})])
    assert mixed[0].outputs[0].token_ids == plain and mixed[1].outputs[0].token_ids == [forced] * 6


def test_a_multi_token_bad_word_is_cut_at_its_last_token(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(PROMPTS[:1], greedy)[0].outputs[0].token_ids
    sequence = plain[1:3]  # the 2nd and 3rd tokens greedy decoding writes, as one "word"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=["x"])
    params.bad_words_token_ids = [sequence]  # NOTE: set as the engine sets it, to name exact tokens
    out = llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    assert out[:2] == plain[:2] and out[2] != plain[2]


@pytest.mark.parametrize("params, message", [
    (dict(logit_bias={5: 101}), "logit_bias values must be in"),
    (dict(logit_bias={"x": 1}), "logit_bias must map token ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(bad_words=[""]), "bad_words must be a list of non-empty strings"),
])
def test_bad_sampling_edits_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_a_token_outside_the_vocabulary_is_refused(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=r"allowed_token_ids must name token ids of this model"):
        llm.generate(PROMPTS[:1], SamplingParams(allowed_token_ids=[vocab]))


def test_logit_bias_over_http(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=128,
                          num_kv_blocks=64)
    with ServerThread(config) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                        logit_bias={"1234": 100}, extra_body={"ignore_eos": True}, logprobs=1)
        assert out.choices[0].logprobs.tokens == [out.choices[0].logprobs.tokens[0]] * 4
        assert math.isfinite(out.choices[0].logprobs.token_logprobs[0])
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, logit_bias={"1234": 300})
        assert refused.value.body["param"] == "logit_bias"
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           logit_bias={str(10**9): 1})
        assert refused.value.body["param"] == "logit_bias"
