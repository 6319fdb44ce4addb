"""/v1/score and /v1/rerank against a brute-force cosine of /v1/embeddings' vectors, on a
live server; bad input in OpenAI's error shape naming the field, the server serving on."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.server.testing import http_request
from helpers import tiny_server

QUERY = "where do cats sleep"
DOCUMENTS = ["cats sleep on the sofa", "the stock market fell", "dogs sleep in the garden", "a cat naps in the sun"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with tiny_server(tiny_llama_dir) as server:
        yield server


def post(server, path, body):
    return http_request(server.url + path, "POST", json=body)


def embeddings(server, texts):
    data = post(server, "/v1/embeddings", {"input": texts}).json()["data"]
    return [np.array(d["embedding"], dtype=np.float64) for d in data]


def cosine(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_score_is_the_cosine_of_the_embeddings_one_to_many_and_pairwise(server):
    query, *docs = embeddings(server, [QUERY, *DOCUMENTS])
    one_to_many = post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in one_to_many["data"]] == list(range(4))
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], [cosine(query, d) for d in docs],
                               rtol=1e-5, atol=1e-6)
    pairwise = post(server, "/score", {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:]}).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               [cosine(docs[0], docs[2]), cosine(docs[1], docs[3])], rtol=1e-5, atol=1e-6)
    assert pairwise["usage"]["prompt_tokens"] > 0


def test_rerank_orders_the_documents_by_that_cosine(server):
    query, *docs = embeddings(server, [QUERY, *DOCUMENTS])
    expected = sorted(range(4), key=lambda i: -cosine(query, docs[i]))
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        answer = post(server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
        assert [r["index"] for r in answer["results"]] == expected[:3]
        assert [r["document"]["text"] for r in answer["results"]] == [DOCUMENTS[i] for i in expected[:3]]
        np.testing.assert_allclose([r["relevance_score"] for r in answer["results"]],
                                   [cosine(query, docs[i]) for i in expected[:3]], rtol=1e-5, atol=1e-6)
    cohere = post(server, "/v1/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
                                         "return_documents": False}).json()
    assert [r["index"] for r in cohere["results"]] == expected and "document" not in cohere["results"][0]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": "", "text_2": "x"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "frobnicate": 1}, "frobnicate"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a", {"title": "b"}]}, "documents[1]"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"documents": ["a"]}, "query"),
])
def test_bad_input_names_the_field_and_the_server_serves_on(server, path, body, param):
    answer = post(server, path, body)
    assert answer.status == 400 and answer.json()["error"]["param"] == param
    assert post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS[:2]}).status == 200
    kv = server.call(lambda: server.engine.scheduler.kv_cache_manager)
    assert server.call(kv.get_num_free_blocks) == kv.num_blocks
