"""The flashinfer backend: FlashInfer's paged-KV decode and prefill wrappers.

The cache is FlashInfer's NHD layout, one key and one value tensor per layer of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` (a "page" is one of our blocks).
Once per step, :func:`plan_paged_kv` turns the step's block tables into FlashInfer's CSR
description of the pages (indptr, indices, last-page lengths) with numpy on the host (the
wrappers' ``plan()`` reads them there: no copy back from the GPU, no sync), for
the decode requests (one query each) and for the rest (prefill chunks, which may sit on
a cached prefix); the two wrappers are planned with it once and then run for every
layer. Keys and values are written into their slots with the base class's indexing.

FlashInfer's kernels need a CUDA device and the ``flashinfer-python`` package
(``pip install 'pagoda[flashinfer]'``). The planning code is tested on the CPU against
the block tables; the kernels only run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.attention_backends.base import AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024
# What FlashInfer 0.7's kernels are built for: half-precision data, these head sizes, and, in the
# decode kernel without tensor cores, these query heads per KV head (DISPATCH_GQA_GROUP_SIZE);
# its tensor-core decode (the prefill kernel) takes any group.
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
PLAIN_DECODE_GROUPS = (1, 2, 3, 4, 6, 8, 16)


def decode_uses_tensor_cores(group: int) -> bool:
    """Whether the decode wrapper takes FlashInfer's tensor-core path: for groups of 4 and
    more, where it is the faster one (as vLLM chooses), and for groups the plain kernel is
    not built for (5 and 7: Qwen2.5's)."""
    return group >= 4 or group not in PLAIN_DECODE_GROUPS


@dataclass(slots=True)
class PagedKV:
    """FlashInfer's description of some requests' pages (CSR over block tables), in host
    memory: ``plan()`` reads them on the host and copies the indices to the GPU itself.

    Attributes:
        indptr: int32 [num_reqs + 1]: request ``i``'s pages are
            ``indices[indptr[i]:indptr[i + 1]]``.
        indices: int32 [total pages]: block ids, in order.
        last_page_len: int32 [num_reqs]: tokens in each request's last page (1..page_size).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


@dataclass(slots=True)
class FlashInferPlan:
    """One step split into its decode requests and its prefill requests.

    Attributes:
        decode_rows: Query rows of the decode requests (one each): a slice where they come
            first, one after the other (the model runner's order: the wrapper then writes
            into the output in place), else an int64 index tensor on the device.
        decode: Their pages.
        prefill_rows: Query rows of the other requests, request after request: a slice or
            an index tensor, as ``decode_rows``.
        prefill_qo_indptr: int32 [num_prefills + 1], on the host: their query rows, as
            offsets into ``prefill_rows``.
        prefill: Their pages.
        num_decodes: Decode rows.
        num_prefill_rows: Prefill rows.
    """

    decode_rows: slice | torch.Tensor
    decode: PagedKV
    prefill_rows: slice | torch.Tensor
    prefill_qo_indptr: torch.Tensor
    prefill: PagedKV
    num_decodes: int
    num_prefill_rows: int


@dataclass(slots=True)
class DecodeGraphPlan:
    """A CUDA graph's decode steps: the bucket's own wrapper, in FlashInfer's CUDA-graph mode."""

    wrapper: object
    dtype: torch.dtype


def paged_kv(seq_lens: np.ndarray, block_tables: np.ndarray, page_size: int, pin: bool = False) -> PagedKV:
    """The CSR page description of requests with these context lengths and block tables
    (``pin``: the arrays plan() copies to the GPU in pinned memory, so the copy does not
    make the host wait)."""
    seq_lens = seq_lens.astype(np.int64)
    num_pages = (seq_lens + page_size - 1) // page_size
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    used = np.arange(block_tables.shape[1])[None, :] < num_pages[:, None]
    indices = block_tables[used].astype(np.int32)  # row-major: each request's pages in order
    last_page_len = (seq_lens - (num_pages - 1) * page_size).astype(np.int32)
    arrays = [torch.from_numpy(a) for a in (indptr, indices, last_page_len)]
    return PagedKV(*(a.pin_memory() for a in arrays) if pin else arrays)


def _rows(rows: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """Query rows as a slice where they are consecutive, else as an index tensor."""
    if len(rows) == 0 or rows[-1] - rows[0] == len(rows) - 1:
        return slice(int(rows[0]), int(rows[-1]) + 1) if len(rows) else slice(0, 0)
    rows = torch.from_numpy(rows)
    return rows.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else rows


def plan_paged_kv(metadata: AttentionMetadata) -> FlashInferPlan:
    """Splits a step into decode and prefill requests and describes their pages, from the
    step's host-side lengths and block tables (nothing read back from the GPU)."""
    device = metadata.block_tables.device
    tables = metadata.block_tables_host
    if tables is None:
        tables = metadata.block_tables.cpu().numpy()
    query_lens = np.asarray(metadata.query_lens, dtype=np.int64)
    seq_lens = np.asarray(metadata.seq_lens, dtype=np.int64)
    starts = np.cumsum(query_lens) - query_lens
    is_decode = query_lens == 1
    prefill_lens = query_lens[~is_decode]
    qo_indptr = np.zeros(len(prefill_lens) + 1, dtype=np.int32)
    np.cumsum(prefill_lens, out=qo_indptr[1:])
    # Each prefill request's rows: its start plus 0..query_len-1.
    owner = np.repeat(np.arange(len(prefill_lens)), prefill_lens)
    prefill_rows = starts[~is_decode][owner] + np.arange(len(owner)) - qo_indptr[:-1][owner]
    decode_rows = starts[is_decode]
    pin = device.type == "cuda"
    return FlashInferPlan(
        decode_rows=_rows(decode_rows, device),
        decode=paged_kv(seq_lens[is_decode], tables[is_decode], metadata.block_size, pin),
        prefill_rows=_rows(prefill_rows, device),
        prefill_qo_indptr=torch.from_numpy(qo_indptr),
        prefill=paged_kv(seq_lens[~is_decode], tables[~is_decode], metadata.block_size, pin),
        num_decodes=len(decode_rows),
        num_prefill_rows=len(prefill_rows),
    )


class FlashInferAttentionBackend(AttentionBackend):
    """FlashInfer's BatchDecode/BatchPrefill wrappers, planned once per step."""

    name = "flashinfer"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._decode_wrapper = None
        self._prefill_wrapper = None
        self._planned: FlashInferPlan | None = None

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            return False
        return True

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str:
        if device.type != "cuda":
            return "FlashInfer's kernels need a CUDA device"
        return "the flashinfer-python package is not installed (pip install 'pagoda[flashinfer]')"

    @classmethod
    def shape_problem(cls, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
        if dtype not in DTYPES:
            return f"FlashInfer's kernels take float16 and bfloat16, not {str(dtype).removeprefix('torch.')}"
        if head_dim not in HEAD_DIMS:
            return f"FlashInfer's kernels take head sizes {', '.join(map(str, HEAD_DIMS))}, not {head_dim}"
        return None

    def _wrappers(self, device: torch.device):
        if self._decode_wrapper is None:
            import flashinfer

            self._workspace = workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=decode_uses_tensor_cores(self.num_heads // self.num_kv_heads))
            self._prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        return self._decode_wrapper, self._prefill_wrapper

    def prepare(self, metadata: AttentionMetadata) -> None:
        metadata.backend_data = plan_paged_kv(metadata)

    supports_decode_graphs = True

    def prepare_decode_graph(self, metadata: AttentionMetadata, kv_dtype: torch.dtype) -> None:
        """A decode wrapper of the bucket's own in FlashInfer's CUDA-graph mode: its page
        arrays live in fixed device buffers, which update_decode_graph's plan() refills
        before each replay (the kernels the graph captured read them there)."""
        import flashinfer

        size, device = metadata.num_reqs, metadata.block_tables.device
        self._wrappers(device)
        # NOTE: the eager wrappers' workspace: one graph or eager step runs at a time.
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=decode_uses_tensor_cores(self.num_heads // self.num_kv_heads),
            paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=torch.zeros(size * metadata.block_tables.shape[1], dtype=torch.int32,
                                                device=device),
            paged_kv_last_page_len_buffer=torch.ones(size, dtype=torch.int32, device=device))
        metadata.backend_data = DecodeGraphPlan(wrapper, kv_dtype)
        # NOTE: planned once here for the capture (every row one token of its first block).
        self.update_decode_graph(metadata, np.ones(size, dtype=np.int32),
                                 metadata.block_tables.cpu().numpy())

    def update_decode_graph(self, metadata: AttentionMetadata, seq_lens: np.ndarray, block_tables: np.ndarray) -> None:
        plan: DecodeGraphPlan = metadata.backend_data
        device = metadata.block_tables.device
        pages = paged_kv(seq_lens, block_tables, metadata.block_size, pin=device.type == "cuda")
        # NOTE: in CUDA-graph mode plan() copies the indices into its buffer without waiting only
        # from the device (from the host it waits for the stream): uploaded here first.
        indices = pages.indices.to(device, non_blocking=True)
        plan.wrapper.plan(pages.indptr, indices, pages.last_page_len, num_qo_heads=self.num_heads,
                          num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, page_size=metadata.block_size,
                          pos_encoding_mode="NONE", q_data_type=plan.dtype, kv_data_type=plan.dtype,
                          sm_scale=self.scale)

    def _plan_wrappers(self, plan: FlashInferPlan, dtype: torch.dtype, device: torch.device, page_size: int):
        decode_wrapper, prefill_wrapper = self._wrappers(device)
        common = dict(num_qo_heads=self.num_heads, num_kv_heads=self.num_kv_heads, page_size=page_size,
                      q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)
        if plan.num_decodes:
            decode_wrapper.plan(plan.decode.indptr, plan.decode.indices, plan.decode.last_page_len,
                                head_dim=self.head_dim, pos_encoding_mode="NONE", **common)
        if plan.num_prefill_rows:
            prefill_wrapper.plan(plan.prefill_qo_indptr, plan.prefill.indptr, plan.prefill.indices,
                                 plan.prefill.last_page_len, head_dim_qk=self.head_dim, causal=True, **common)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        plan: FlashInferPlan | DecodeGraphPlan = metadata.backend_data
        key_cache, _ = kv_cache
        query = query.to(key_cache.dtype)
        if isinstance(plan, DecodeGraphPlan):  # a decode graph's step: every row one query
            output = torch.empty_like(query)
            plan.wrapper.run(query, kv_cache, out=output)
            return output
        if self._planned is not plan:
            # NOTE: the wrappers are planned on the first layer of a step, where the dtype
            # and device are known; every later layer of the step reuses the plan.
            self._plan_wrappers(plan, query.dtype, query.device, key_cache.shape[1])
            self._planned = plan
        decode_wrapper, prefill_wrapper = self._wrappers(query.device)
        output = torch.empty_like(query)
        for count, rows, wrapper in ((plan.num_decodes, plan.decode_rows, decode_wrapper),
                                     (plan.num_prefill_rows, plan.prefill_rows, prefill_wrapper)):
            if not count:
                continue
            if isinstance(rows, slice):  # in place: no gather of the queries, no scatter of the output
                wrapper.run(query[rows], kv_cache, out=output[rows])
            else:
                output[rows] = wrapper.run(query[rows], kv_cache)
        return output
