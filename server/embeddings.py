"""POST /v1/embeddings: each input is one engine request that pools its prompt's final
hidden states (engine/frontend/embedding.py), under the same limits, budget and
scheduler as generation."""

from __future__ import annotations

import asyncio
import base64
import uuid
from contextlib import aclosing
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from pagoda.engine.exceptions import (AdmissionPluginFailed, EngineDeadError, RequestInterrupted, RequestRejected,
                                      StepError)
from pagoda.engine.frontend.embedding import embedding_of, embedding_params
from pagoda.engine.frontend.output_processor import OutputKind
from pagoda.server.errors import APIError, bad_request
from pagoda.server.protocol import EmbeddingRequest, parse_embedding
from pagoda.server.serving import read_json, rejection_error, serve_tracked
from pagoda.server.state import ServerState, cut_off, shutting_down
from pagoda.server.streaming import merge
from pagoda.server.tracing import RequestSpan


async def embeddings(request: web.Request) -> web.StreamResponse:
    """POST /v1/embeddings."""
    return await serve_tracked(request, "embeddings", _embed)


async def _embed(request: web.Request, state: ServerState, span: RequestSpan, client: str) -> web.Response:
    engine = state.engine
    emb = parse_embedding(await read_json(request), state.config)
    model = state.resolve_model(emb.model)
    hidden_size = engine.model_config.hidden_size
    if emb.dimensions is not None and emb.dimensions != hidden_size:
        raise bad_request(f"'dimensions' must be {hidden_size} (this model's embedding size) or left out: the "
                          "model was not trained to shorten its embeddings", "dimensions")
    vectors, ids_list = await embed(state, emb, client, "input")
    data = [{"object": "embedding", "index": i, "embedding": _encode(vector, emb.encoding_format)}
            for i, vector in enumerate(vectors)]
    num_prompt = sum(len(ids) for ids in ids_list)
    payload = {"object": "list", "data": data, "model": model,
               "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt}}
    return web.Response(body=orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), content_type="application/json")


async def embed(state: ServerState, emb: EmbeddingRequest, client: str, field: str
                ) -> tuple[list[np.ndarray], list[list[int]]]:
    """``emb``'s inputs embedded (and their token ids), under the same limits and per-client
    budget as generation; errors name ``field``."""
    limits = state.limits
    state.check_can_serve()
    state.budget.check_room(client)
    limits.check_sequences(len(emb.inputs), field)
    for text in emb.inputs:
        if isinstance(text, str):
            limits.check_chars(len(text), field)
    ids_list = await _tokenize(state, emb, client, field)
    for ids in ids_list:
        state.check_length(len(ids), None, field)
    num_tokens = sum(len(ids) + 1 for ids in ids_list)
    limits.check_tokens(num_tokens, field)
    state.budget.charge(client, len(ids_list), num_tokens)
    try:
        return await _run(state, emb, ids_list, client, field), ids_list
    finally:
        state.budget.release(client, len(ids_list), num_tokens)


async def _tokenize(state: ServerState, emb: EmbeddingRequest, client: str, field: str) -> list[list[int]]:
    texts = [i for i in emb.inputs if isinstance(i, str)]
    encoded = iter(await asyncio.gather(*(state.run_tokenizer(state.encode, t, emb.add_special_tokens, client=client,
                                                              cost=len(t)) for t in texts)))
    ids_list = []
    for item in emb.inputs:
        if isinstance(item, str):
            ids_list.append(next(encoded))
            continue
        try:
            ids_list.append(state.engine.encode_prompt(item))
        except ValueError as exc:
            raise bad_request(str(exc), field) from None
    return ids_list


async def _run(state: ServerState, emb: EmbeddingRequest, ids_list: list[list[int]], client: str,
               field: str) -> list[np.ndarray]:
    engine = state.engine
    params = embedding_params(engine.config)
    base_id = f"embd-{uuid.uuid4().hex}"
    if state.interrupted:
        raise shutting_down()  # NOTE: tokenized while the drain ran out
    streams = []
    try:
        for i, ids in enumerate(ids_list):
            streams.append(engine.add_request(ids, params, request_id=f"{base_id}-{i}", prompt_token_ids=ids,
                                              priority=emb.priority, client=client, output_kind=OutputKind.FINAL,
                                              lora_name=state.lora_of(emb.model)))
        finals: list[Any] = [None] * len(streams)
        async with aclosing(merge([engine.stream_outputs(stream) for stream in streams])) as outputs:
            async for index, out in outputs:
                if out.finished:
                    finals[index] = out
    except (ValueError, RequestRejected, AdmissionPluginFailed, EngineDeadError, StepError, RequestInterrupted,
            asyncio.CancelledError) as exc:
        for stream in streams:
            engine.abort(stream.request_id)
        if isinstance(exc, RequestRejected):
            raise rejection_error(exc) from None
        if isinstance(exc, RequestInterrupted):
            raise cut_off(exc) from None
        if isinstance(exc, EngineDeadError):
            raise APIError(503, f"The engine is not running: {exc}", code="engine_dead") from None
        if isinstance(exc, AdmissionPluginFailed):
            raise APIError(500, str(exc), code="admission_plugin_failed") from None
        if isinstance(exc, StepError):
            raise APIError(500, f"Embedding failed: {exc}", code="embedding_failed") from None
        if isinstance(exc, ValueError):
            raise bad_request(str(exc), field) from None
        raise
    return [embedding_of(out, engine.config) for out in finals]


def _encode(vector: np.ndarray, encoding_format: str) -> Any:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector
