"""Embeddings from the loaded model: an embedding request is a generation request that
pools its prompt's final hidden states (the worker does that as the prompt's last chunk
runs) and stops after one token, freeing its KV blocks at once.

The scheduler, the KV budget and every plugin treat it as any other request.
"""

from __future__ import annotations

import numpy as np

from pagoda.engine.config import EngineConfig
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.sampling_params import SamplingParams


def embedding_params(config: EngineConfig) -> SamplingParams:
    """Sampling parameters of an embedding request (the one token it samples is dropped)."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling=config.pooling)


def embedding_of(output: RequestOutput, config: EngineConfig) -> np.ndarray:
    """The finished embedding request's vector: float32, unit length when the engine
    normalises (``normalize_embeddings``)."""
    vector = np.asarray(output.embedding, dtype=np.float32)
    if config.normalize_embeddings:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector
