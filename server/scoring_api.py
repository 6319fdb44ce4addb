"""``POST /v1/score`` (vLLM's) and ``POST /v1/rerank`` (Jina's and Cohere's shape): how alike
texts are, as the cosine of their embeddings (the same pooled final hidden states as
/v1/embeddings, under its limits), so an embedding model served by Pagoda scores and reranks.

A score is the cosine of the two texts' embeddings, in [-1, 1]; a cross-encoder's classifier
head (which vLLM runs for its rerankers) is not among the model families Pagoda loads.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from pagoda.server.embeddings import embed
from pagoda.server.errors import bad_request
from pagoda.server.protocol import Body, EmbeddingRequest, check_fields
from pagoda.server.serving import read_json, serve_tracked
from pagoda.server.state import ServerState
from pagoda.server.tracing import RequestSpan

SCORE_FIELDS = frozenset({"model", "text_1", "text_2", "encoding_format", "truncate_prompt_tokens", "user",
                          "priority", "add_special_tokens"})
RERANK_FIELDS = frozenset({"model", "query", "documents", "top_n", "return_documents", "max_chunks_per_doc",
                           "rank_fields", "truncate_prompt_tokens", "user", "priority"})


#: Fields of vLLM's, Jina's and Cohere's requests that Pagoda cannot honour: a 400 unless null.
UNSUPPORTED = ("truncate_prompt_tokens", "encoding_format", "max_chunks_per_doc", "rank_fields")


def _refuse_unsupported(b: Body) -> None:
    for name in UNSUPPORTED:
        if b.get(name) is not None:
            raise bad_request(f"'{name}' is not supported by this server (prompts longer than the context are a 400; "
                              f"documents are plain text)", name, code="unsupported_parameter")


def _texts(value: Any, name: str) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
        raise bad_request(f"'{name}' must be a non-empty string or a non-empty list of non-empty strings", name)
    return values


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / norm) if norm else 0.0


async def _vectors(state: ServerState, b: Body, texts: list[str], client: str, field: str):
    state.resolve_model(b.str_("model"))
    emb = EmbeddingRequest(model=b.str_("model"), inputs=texts, priority=b.int_("priority", 0),
                           add_special_tokens=b.bool_("add_special_tokens", True))
    return await embed(state, emb, client, field)


async def score(request: web.Request) -> web.StreamResponse:
    """POST /v1/score: ``text_1`` against each of ``text_2`` (one text against many, or two
    lists of the same length pair by pair)."""
    return await serve_tracked(request, "score", _score)


async def _score(request: web.Request, state: ServerState, span: RequestSpan, client: str) -> web.Response:
    b = check_fields(await read_json(request), SCORE_FIELDS)
    _refuse_unsupported(b)
    first, second = _texts(b.get("text_1"), "text_1"), _texts(b.get("text_2"), "text_2")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise bad_request(f"'text_1' has {len(first)} texts and 'text_2' {len(second)}: give one 'text_1', or as many "
                          "as 'text_2'", "text_2")
    unique = list(dict.fromkeys(first + second))  # NOTE: each text embedded once
    vectors, ids = await _vectors(state, b, unique, client, "text_1")
    index = {text: i for i, text in enumerate(unique)}
    data = [{"index": i, "object": "score", "score": cosine(vectors[index[a]], vectors[index[c]])}
            for i, (a, c) in enumerate(zip(first, second))]
    num_tokens = sum(len(t) for t in ids)
    payload = {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
               "model": state.resolve_model(b.str_("model")), "data": data,
               "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


async def rerank(request: web.Request) -> web.StreamResponse:
    """POST /v1/rerank (also /rerank, /v2/rerank): ``documents`` ordered by their score against
    ``query``, the best first, the first ``top_n``."""
    return await serve_tracked(request, "rerank", _rerank)


async def _rerank(request: web.Request, state: ServerState, span: RequestSpan, client: str) -> web.Response:
    b = check_fields(await read_json(request), RERANK_FIELDS)
    _refuse_unsupported(b)
    query = b.get("query")
    if not isinstance(query, str) or not query:
        raise bad_request("'query' must be a non-empty string", "query")
    documents = b.get("documents")
    if not isinstance(documents, list) or not documents:
        raise bad_request("'documents' must be a non-empty list of strings or {\"text\": ...} objects", "documents")
    texts = []
    for i, document in enumerate(documents):
        text = document.get("text") if isinstance(document, dict) else document
        if not isinstance(text, str) or not text:
            raise bad_request(f"'documents[{i}]' must be a non-empty string or {{\"text\": ...}}", f"documents[{i}]")
        texts.append(text)
    top_n = b.int_("top_n", len(texts), 1)
    vectors, ids = await _vectors(state, b, [query, *texts], client, "documents")
    scores = [cosine(vectors[0], vector) for vector in vectors[1:]]
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[:top_n]
    with_documents = b.bool_("return_documents", True)
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}} if with_documents
                                                             else {})} for i in order]
    num_tokens = sum(len(t) for t in ids)
    payload = {"id": f"rerank-{uuid.uuid4().hex}", "model": state.resolve_model(b.str_("model")),
               "results": results, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/score", score)
    app.router.add_post("/score", score)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
