"""The decode graphs' buckets, padding and plans, on the CPU: DecodeGraphs without capture
runs the same static buffers eagerly, with the triton kernels under the interpreter. The
capture and replay themselves run only on a GPU (tests/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.attention_backends import AttentionMetadata, get_attention_backend
from pagoda.engine.model_config import ModelConfig
from pagoda.engine.model_loader import load_weights
from pagoda.engine.models.decoder import DecoderForCausalLM
from pagoda.engine.worker.cuda_graphs import DecodeGraphs, bucket_sizes

BLOCK_SIZE, NUM_BLOCKS, MAX_LEN = 4, 24, 64


def test_every_batch_runs_in_the_smallest_bucket_that_holds_it():
    assert bucket_sizes(8) == [1, 2, 4, 8] and bucket_sizes(256)[-3:] == [192, 224, 256]
    assert bucket_sizes(100)[-3:] == [64, 96, 100]  # max_num_seqs itself is the last
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.sizes = bucket_sizes(100)
    assert [graphs.bucket(n) for n in (1, 3, 17, 96, 97, 100, 101)] == [1, 4, 24, 96, 100, 100, None]


@pytest.fixture
def triton_model(tiny_llama_dir, triton_interpreter):
    config = ModelConfig.from_dir(tiny_llama_dir)
    backend = get_attention_backend("triton", torch.device("cpu"))(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.head_dim**-0.5)
    model = DecoderForCausalLM(config, backend, MAX_LEN).float()
    model.load_weights(load_weights(tiny_llama_dir))
    shapes = backend.kv_cache_shapes(NUM_BLOCKS + 1, BLOCK_SIZE)  # + the scratch block
    caches = [tuple(torch.zeros(shape) for shape in shapes) for _ in range(config.num_hidden_layers)]
    return model.eval(), caches


def eager_step(model, caches, tokens, positions, tables):
    """One step of requests (their new tokens and positions, their blocks) without graphs."""
    query_lens = [len(p) for p in positions]
    seq_lens = [p[-1] + 1 for p in positions]
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        num_tokens=sum(query_lens), query_lens=query_lens, seq_lens=seq_lens,
        query_start_loc=torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor([t[q // BLOCK_SIZE] * BLOCK_SIZE + q % BLOCK_SIZE
                                   for t, p in zip(tables, positions) for q in p]),
        block_size=BLOCK_SIZE, max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    model.layers[0].self_attn.backend.prepare(metadata)
    with torch.inference_mode():
        return model(torch.tensor([t for ts in tokens for t in ts]), torch.tensor([q for p in positions for q in p]),
                     caches, metadata)


@pytest.fixture
def triton_interpreter():
    pytest.importorskip("triton", reason="the triton package is not installed (pip install 'pagoda[triton]')")


@pytest.mark.parametrize("num_reqs,split", [(1, False), (3, False), (5, True)],
                         ids=["one", "three-padded-to-4", "five-padded-to-8-split-kv"])
def test_a_padded_bucket_gives_each_request_what_the_eager_step_gives(triton_model, monkeypatch, num_reqs, split):
    """Requests with contexts of 5-19 tokens prefilled eagerly, then one decode of them run in
    the bucket's static buffers (rows past them padding): the same hidden states as the eager
    decode, and nothing written outside their new slots but the scratch block."""
    from pagoda.attention_backends import triton_attention

    if split:  # parts of 16 keys over the 64-token max_model_len: 4 parts
        monkeypatch.setattr(triton_attention, "SPLIT_MIN_LEN", 16)
    model, caches = triton_model
    rng = np.random.default_rng(num_reqs)
    lens = [5 + 7 * i % 15 for i in range(num_reqs)]
    tables = [list(range(5 * i, 5 * i + 5)) for i in range(num_reqs)]  # 5 blocks of 4 each
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in lens]
    eager_step(model, caches, prompts, [list(range(n)) for n in lens], tables)
    new = rng.integers(0, model.config.vocab_size, num_reqs)
    graphs = DecodeGraphs(model, caches, max_num_seqs=8, max_model_len=MAX_LEN, block_size=BLOCK_SIZE,
                          scratch_block=NUM_BLOCKS, capture=False)
    graphs.capture_all()
    assert graphs.metadata(graphs.bucket(num_reqs)).backend_data[0].num_splits == (4 if split else 1)
    before = [tuple(t.clone() for t in layer) for layer in caches]
    table_array = np.array(tables, dtype=np.int32)
    slots = table_array[np.arange(num_reqs), np.array(lens) // BLOCK_SIZE] * BLOCK_SIZE + np.array(lens) % BLOCK_SIZE
    with torch.inference_mode():
        replayed = graphs.run(new, np.array(lens), np.array(lens) + 1, table_array, slots.astype(np.int64)).clone()
    changed = {(int(b), int(s)) for layer, old in zip(caches, before) for t, o in zip(layer, old)
               for b, s in torch.nonzero((t != o).flatten(2).any(-1) if t.dim() == 4 else (t != o))[:, :2].tolist()}
    blocks_written = {b for b, _ in changed}
    assert blocks_written <= {s // BLOCK_SIZE for s in slots} | {NUM_BLOCKS}
    expected = eager_step(model, caches, [[int(t)] for t in new], [[n] for n in lens], tables)
    torch.testing.assert_close(replayed, expected, rtol=1e-4, atol=1e-5)
    assert graphs.check(NUM_BLOCKS, model.config.vocab_size) is None
