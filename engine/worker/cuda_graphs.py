"""CUDA graphs of decode steps: the model's forward for a batch of decodes, captured once per
batch-size bucket at start-up and replayed, so that a step launches one graph instead of a
thousand kernels (a 30-layer model's decode launches ~1,300).

A step of ``n`` decodes runs the graph of the smallest bucket ``size >= n``: its inputs are
written into static buffers (the graph reads them where it was captured), rows ``n..size``
are padding that reads and writes only the scratch block, a block past the pool's that no
request ever gets. The attention backend plans such a step once per bucket, from nothing
but its size (``AttentionBackend.prepare_decode_graph``): the captured kernels may not depend
on the step's lengths on the host, which the graph cannot see; what a backend keeps beside the
buffers it refreshes before each replay (``update_decode_graph``: FlashInfer's page arrays).
Only backends that can (``supports_decode_graphs``: triton, flashinfer) take graphs; the
others, prefill chunks, tensor parallelism and draft models run eagerly.

After capturing, each bucket is replayed once against the same forward run eagerly over the
same buffers (``check``): a mismatch turns the graphs off with a warning rather than
serving wrong tokens. ``--enforce-eager`` turns them off.

``capture=False`` builds the same buckets and buffers without graphs (the forward runs
eagerly over them): how the CPU suite checks the padding and the buckets' plans.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from pagoda.attention_backends import AttentionMetadata

logger = logging.getLogger(__name__)

# Batch sizes captured (up to max_num_seqs): every step of n decodes runs the first >= n.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """The buckets up to max_num_seqs, and max_num_seqs itself as the last."""
    sizes = [size for size in BUCKETS if size < max_num_seqs]
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """The captured forwards of decode batches, one per bucket, and their static inputs.

    Args:
        model: The model (its forward returns the hidden states).
        kv_caches: The caches the graphs read and write (one scratch block past the pool's).
        max_num_seqs: The largest batch.
        max_model_len: The longest context (the block tables' width).
        block_size: Tokens per block.
        scratch_block: The block the padding rows use.
        capture: Capture CUDA graphs (False: run the same buffers eagerly, for tests).
    """

    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int,
                 scratch_block: int, capture: bool = True) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.backend = model.layers[0].self_attn.backend
        self.sizes = bucket_sizes(max_num_seqs)
        self.block_size, self.scratch_block, self.capture = block_size, scratch_block, capture
        self.max_model_len = max_model_len
        largest, width = self.sizes[-1], -(-max_model_len // block_size)
        device = kv_caches[0][0].device
        # The step's inputs, written before each replay: on the device (what the graphs read)
        # and in pinned host memory (what the host fills; copied without a wait).
        self._device = {
            "input_ids": torch.zeros(largest, dtype=torch.long, device=device),
            "positions": torch.zeros(largest, dtype=torch.long, device=device),
            "seq_lens": torch.ones(largest, dtype=torch.int32, device=device),
            "block_tables": torch.full((largest, width), scratch_block, dtype=torch.int32, device=device),
            "slot_mapping": torch.full((largest,), scratch_block * block_size, dtype=torch.int64, device=device),
        }
        pin = device.type == "cuda"
        self._pinned = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for name, t in self._device.items()}
        self._host = {name: t.numpy() for name, t in self._pinned.items()}  # the same memory
        self._query_start = torch.arange(largest + 1, dtype=torch.int32, device=device)
        # Recorded after each step's copies: the next step's host writes wait for it (a step
        # that samples nothing ends without the token fetch that would have waited).
        self._copied: torch.cuda.Event | None = None
        self._metadata: dict[int, AttentionMetadata] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.capture_seconds = 0.0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of bucket ``size``: views of the static buffers, planned
        once by the backend for any ``size`` decodes."""
        if size not in self._metadata:
            d = self._device
            metadata = AttentionMetadata(
                num_tokens=size, query_lens=[1] * size, seq_lens=[self.max_model_len] * size,
                query_start_loc=self._query_start[: size + 1], seq_lens_tensor=d["seq_lens"][:size],
                block_tables=d["block_tables"][:size], slot_mapping=d["slot_mapping"][:size],
                block_size=self.block_size, max_query_len=1, max_seq_len=self.max_model_len)
            self.backend.prepare_decode_graph(metadata, self.kv_caches[0][0].dtype)
            self._metadata[size] = metadata
        return self._metadata[size]

    def _forward(self, size: int) -> torch.Tensor:
        d = self._device
        return self.model(d["input_ids"][:size], d["positions"][:size], self.kv_caches, self.metadata(size))

    def capture_all(self) -> None:
        """Captures every bucket, the largest first (the others reuse its memory pool)."""
        start = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):
                if not self.capture:
                    self._graphs[size] = (None, None)
                    continue
                # NOTE: a warm-up run on a side stream first, as torch's CUDA graph docs ask
                # (lazy initialisations must not land in the graph).
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._forward(size)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(size)
                pool = graph.pool()
                self._graphs[size] = (graph, out)
        if self.capture:
            torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start

    def bucket(self, num_reqs: int) -> int | None:
        """The bucket that runs ``num_reqs`` decodes (None: more than the largest)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def fill(self, input_ids: np.ndarray, positions: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
             slot_mapping: np.ndarray) -> int:
        """Writes a step of ``n`` decodes into the static buffers, rows past ``n`` up to the
        bucket as padding over the scratch block; returns the bucket."""
        n = len(input_ids)
        size = self.bucket(n)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the pinned buffers
        h = self._host
        h["input_ids"][:n], h["input_ids"][n:size] = input_ids, 0
        h["positions"][:n], h["positions"][n:size] = positions, 0
        h["seq_lens"][:n], h["seq_lens"][n:size] = seq_lens, 1
        h["slot_mapping"][:n], h["slot_mapping"][n:size] = slot_mapping, self.scratch_block * self.block_size
        # NOTE: columns past a request's blocks keep earlier steps' ids: the kernels read only
        # the blocks a context covers, and a padding row (one token) only its first.
        h["block_tables"][:n, : block_tables.shape[1]] = block_tables
        h["block_tables"][n:size, 0] = self.scratch_block
        self.backend.update_decode_graph(self.metadata(size), h["seq_lens"][:size], h["block_tables"][:size])
        for name, device in self._device.items():
            # NOTE: whole rows of the block tables, contiguous (the graphs read them with the
            # full width's stride): a non-contiguous source would be copied through pageable memory.
            device[:size].copy_(self._pinned[name][:size], non_blocking=True)
        if self._pinned["input_ids"].is_pinned():
            self._copied = torch.cuda.Event()
            self._copied.record()
        return size

    def run(self, input_ids: np.ndarray, positions: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
            slot_mapping: np.ndarray) -> torch.Tensor:
        """The hidden states of a step of decodes (host arrays of its ``n`` requests): [n, hidden]."""
        size = self.fill(input_ids, positions, seq_lens, block_tables, slot_mapping)
        graph, out = self._graphs[size]
        if graph is None:
            out = self._forward(size)
        else:
            graph.replay()
        # NOTE: a copy: the graph's output is overwritten by the next replay.
        return out[: len(input_ids)].clone()

    def check(self, num_blocks: int, vocab_size: int) -> str | None:
        """Replays every bucket against the eager forward over the same inputs (random tokens,
        contexts over free blocks of their own, as long as the blocks allow: at start-up every
        block is free; long ones reach the later parts of split-KV); returns what differed, or
        None."""
        gen = torch.Generator().manual_seed(0)
        width = -(-self.max_model_len // self.block_size)
        with torch.inference_mode():
            for size in self.sizes:
                n = min(size, num_blocks)
                per_request = max(1, min(num_blocks // n, width))
                lens = torch.randint(1, per_request * self.block_size + 1, (n,), generator=gen).numpy()
                lens = np.minimum(lens, self.max_model_len).astype(np.int32)
                ids = torch.randint(0, vocab_size, (n,), generator=gen).numpy()
                blocks = np.arange(n * per_request, dtype=np.int32).reshape(n, per_request)
                last = lens - 1
                slots = blocks[np.arange(n), last // self.block_size].astype(np.int64) * self.block_size
                args = (ids, last, lens, blocks, slots + last % self.block_size)
                replayed = self.run(*args).float().clone()
                self.fill(*args)
                eager = self._forward(self.bucket(n))[:n].float()
                if not torch.allclose(replayed, eager, rtol=1e-3, atol=1e-3):
                    worst = (replayed - eager).abs().max().item()
                    return f"batch {n}: the replayed forward differs from the eager one by up to {worst:.3g}"
        return None
