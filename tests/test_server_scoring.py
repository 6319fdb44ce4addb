"""Scoring and embeddings over HTTP: echo with logprobs, max_tokens 0, prompt_logprobs,
/v1/embeddings, with the openai client and lm-eval-harness against a live server."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.server.testing import ServerThread, http_request
from helpers import make_hf_model

DATA = Path(__file__).parent / "data" / "lm_eval"
PROMPT = "Paged attention stores keys and values in blocks"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32", max_model_len=256,
                          block_size=8, num_kv_blocks=256, max_num_batched_tokens=16)
    with ServerThread(config) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return make_hf_model(tiny_llama_dir)


def prompt_logprobs_of(hf, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def assert_nothing_lost(server) -> None:
    kv = server.engine.scheduler.kv_cache_manager
    server.call(kv.check_invariants)
    assert server.call(kv.get_num_free_blocks) == kv.num_blocks


def test_echo_with_logprobs_scores_the_prompt(server, client, model, hf):
    ids = server.engine.tokenizer.encode(PROMPT)
    want = prompt_logprobs_of(hf, ids)
    choice = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=2,
                                       temperature=0).choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert np.allclose(lp.token_logprobs[1:len(ids)], want, atol=1e-3)
    assert all(len(top) in (2, 3) for top in lp.top_logprobs[1:])  # the top 2 and the token itself
    token_text = [server.engine.tokenizer.decode([t]) for t in ids]
    assert lp.tokens[:len(ids)] == token_text
    assert lp.text_offset[:len(ids)] == list(np.cumsum([0] + [len(t) for t in token_text[:-1]]))
    assert lp.text_offset[len(ids)] == len(PROMPT)  # the output's offsets follow the echoed text
    # Scoring only: nothing generated, nothing counted as completion.
    scored = client.completions.create(model=model, prompt=[ids, ids[:4]], echo=True, logprobs=0, max_tokens=0)
    assert [c.text for c in scored.choices] == [PROMPT, server.engine.tokenizer.decode(ids[:4])]
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
    assert len(scored.choices[1].logprobs.tokens) == 4
    assert scored.choices[0].finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids) + 4
    assert_nothing_lost(server)


def test_echo_with_logprobs_streams_the_prompt_first(server, client, model, hf):
    ids = server.engine.tokenizer.encode(PROMPT)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT)
    assert first.logprobs.token_logprobs[0] is None
    assert np.allclose(first.logprobs.token_logprobs[1:len(ids)], prompt_logprobs_of(hf, ids), atol=1e-3)
    whole = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                      temperature=0).choices[0]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs


def test_prompt_logprobs_field_in_vllms_shape(server, client, model, hf):
    ids = server.engine.tokenizer.encode(PROMPT)
    want = prompt_logprobs_of(hf, ids)
    choice = client.completions.create(model=model, prompt=PROMPT, max_tokens=1,
                                       extra_body={"prompt_logprobs": 3}).choices[0]
    positions = choice.model_extra["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(ids)
    for token_id, expected, position in zip(ids[1:], want, positions[1:]):
        own = position[str(token_id)]
        assert own["logprob"] == pytest.approx(expected, abs=1e-3)
        ranks = sorted(entry["rank"] for entry in position.values())
        assert ranks[:3] == [1, 2, 3] or own["rank"] <= 3
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    rendered = chat.model_extra["prompt_logprobs"]
    assert rendered[0] is None and len(rendered) == chat.usage.prompt_tokens
    assert all(len(position) == 1 for position in rendered[1:])


def test_embeddings_endpoint(server, client, model, hf):
    texts = ["The quick brown fox", "jumps over the lazy dog", "x"]
    batch = client.embeddings.create(model=model, input=texts)
    assert [d.index for d in batch.data] == [0, 1, 2]
    ids = [server.engine.tokenizer.encode(t) for t in texts]
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(len(i) for i in ids)
    for text, token_ids, item in zip(texts, ids, batch.data):
        with torch.no_grad():
            state = hf.model(torch.tensor([token_ids])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(state, dim=0).numpy()
        vector = np.array(item.embedding, dtype=np.float32)
        assert float(vector @ want) >= 0.9999
        alone = client.embeddings.create(model=model, input=text).data[0].embedding
        assert np.allclose(alone, vector, atol=1e-5)
    by_ids = client.embeddings.create(model=model, input=ids[0], encoding_format="base64").data[0].embedding
    # NOTE: the openai client decodes base64 itself when it asked for floats; asked for base64, it is a string.
    decoded = np.frombuffer(base64.b64decode(by_ids), dtype="<f4") if isinstance(by_ids, str) else np.array(by_ids)
    assert np.allclose(decoded, batch.data[0].embedding, atol=1e-5)
    raw = http_request(server.url + "/v1/embeddings", "POST", json={"input": [ids[1]], "dimensions": 64})
    assert raw.status == 200 and np.allclose(raw.json()["data"][0]["embedding"], batch.data[1].embedding, atol=1e-5)
    assert_nothing_lost(server)


BAD_REQUESTS = [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": [[]]}, "input"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"input": [list(range(300))]}, "input"),
    ("/v1/embeddings", {"input": [[1, 2, 10**9]]}, "input"),
    ("/v1/embeddings", {"input": "hi", "temperature": 0}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "n": 2}, "echo"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "best_of": 2, "n": 2}, "echo"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": -1},
     "prompt_logprobs"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS, ids=[f"{p}:{sorted(b)}" for p, b, _ in BAD_REQUESTS])
def test_bad_scoring_requests_get_400_in_openais_shape(server, path, body, param):
    result = http_request(server.url + path, "POST", json=body)
    assert result.status == 400, result.text
    error = result.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    ok = http_request(server.url + "/v1/embeddings", "POST", json={"input": "still serving"})
    assert ok.status == 200
    assert_nothing_lost(server)


@pytest.mark.slow
def test_lm_eval_harness_against_the_server_equals_its_hf_model(server, model, tiny_llama_dir, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")  # the test extra installs it
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    # The tasks read the data file the test ships (a path the YAML cannot know beforehand).
    for task_file in DATA.glob("*.yaml"):
        text = task_file.read_text().replace("tiny_qa.jsonl", str(DATA / "tiny_qa.jsonl"))
        (tmp_path / task_file.name).write_text(text)
    tasks = TaskManager(include_path=str(tmp_path))
    names = ["pagoda_tiny_mc", "pagoda_tiny_gen"]
    served = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={model},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={tiny_llama_dir},max_length=256,tokenized_requests=True,num_concurrent=2",
        tasks=names, task_manager=tasks, log_samples=True)
    local = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={tiny_llama_dir},dtype=float32,max_length=256",
                                    tasks=names, task_manager=tasks, log_samples=True, device="cpu")
    ours = {s["doc_id"]: s["filtered_resps"] for s in served["samples"]["pagoda_tiny_mc"]}
    theirs = {s["doc_id"]: s["filtered_resps"] for s in local["samples"]["pagoda_tiny_mc"]}
    assert sorted(ours) == sorted(theirs) == list(range(6))
    for doc_id, choices in ours.items():
        assert len(choices) == 3
        for (loglikelihood, greedy), (expected, expected_greedy) in zip(choices, theirs[doc_id]):
            assert loglikelihood == pytest.approx(expected, abs=1e-3)
            assert greedy == expected_greedy
    generated = {s["doc_id"]: s["filtered_resps"] for s in served["samples"]["pagoda_tiny_gen"]}
    expected = {s["doc_id"]: s["filtered_resps"] for s in local["samples"]["pagoda_tiny_gen"]}
    assert generated == expected and all(r[0] for r in generated.values())
    assert served["results"]["pagoda_tiny_mc"]["acc,none"] == local["results"]["pagoda_tiny_mc"]["acc,none"]
    assert_nothing_lost(server)
