"""The flashinfer backend: FlashInfer's paged-KV decode and prefill wrappers.

The cache is FlashInfer's NHD layout, one key and one value tensor per layer of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` (a "page" is one of our blocks).
Once per step, :func:`plan_paged_kv` turns the step's block tables into FlashInfer's CSR
description of the pages (indptr, indices, last-page lengths) with plain torch code, for
the decode requests (one query each) and for the rest (prefill chunks, which may sit on
a cached prefix); the two wrappers are planned with it once and then run for every
layer. Keys and values are written into their slots with the base class's indexing.

FlashInfer's kernels need a CUDA device and the ``flashinfer-python`` package
(``pip install 'pagoda[flashinfer]'``). The planning code is tested on the CPU against
the block tables; the kernels only run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """FlashInfer's description of some requests' pages (CSR over block tables).

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
        decode_rows: Query rows of the decode requests (one each), int64.
        decode: Their pages.
        prefill_rows: Query rows of the other requests, request after request, int64.
        prefill_qo_indptr: int32 [num_prefills + 1]: their query rows, as offsets into
            ``prefill_rows``.
        prefill: Their pages.
    """

    decode_rows: torch.Tensor
    decode: PagedKV
    prefill_rows: torch.Tensor
    prefill_qo_indptr: torch.Tensor
    prefill: PagedKV

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.numel())

    @property
    def num_prefill_rows(self) -> int:
        return int(self.prefill_rows.numel())


def paged_kv(seq_lens: torch.Tensor, block_tables: torch.Tensor, page_size: int) -> PagedKV:
    """The CSR page description of requests with these context lengths and block tables."""
    seq_lens = seq_lens.to(torch.int64)
    num_pages = (seq_lens + page_size - 1) // page_size
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=seq_lens.device)
    torch.cumsum(num_pages, 0, out=indptr[1:])
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = columns.unsqueeze(0) < num_pages.unsqueeze(1)
    indices = block_tables[used].to(torch.int32)  # row-major: each request's pages in order
    last_page_len = (seq_lens - (num_pages - 1) * page_size).to(torch.int32)
    return PagedKV(indptr, indices, last_page_len)


def plan_paged_kv(metadata: AttentionMetadata) -> FlashInferPlan:
    """Splits a step into decode and prefill requests and describes their pages."""
    device = metadata.block_tables.device
    query_lens = torch.tensor(metadata.query_lens, dtype=torch.int64, device=device)
    starts = metadata.query_start_loc[:-1].to(torch.int64)
    is_decode = query_lens == 1
    decode_idx = torch.nonzero(is_decode).flatten()
    prefill_idx = torch.nonzero(~is_decode).flatten()
    prefill_lens = query_lens[prefill_idx]
    qo_indptr = torch.zeros(len(prefill_idx) + 1, dtype=torch.int32, device=device)
    torch.cumsum(prefill_lens, 0, out=qo_indptr[1:])
    # Each prefill request's rows: its start plus 0..query_len-1.
    owner = torch.repeat_interleave(torch.arange(len(prefill_idx), device=device), prefill_lens)
    prefill_rows = starts[prefill_idx][owner] + torch.arange(len(owner), device=device) - qo_indptr[:-1].long()[owner]
    seq_lens = metadata.seq_lens_tensor
    return FlashInferPlan(
        decode_rows=starts[decode_idx],
        decode=paged_kv(seq_lens[decode_idx], metadata.block_tables[decode_idx], metadata.block_size),
        prefill_rows=prefill_rows,
        prefill_qo_indptr=qo_indptr,
        prefill=paged_kv(seq_lens[prefill_idx], metadata.block_tables[prefill_idx], metadata.block_size),
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

            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=decode_uses_tensor_cores(self.num_heads // self.num_kv_heads))
            self._prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        return self._decode_wrapper, self._prefill_wrapper

    def prepare(self, metadata: AttentionMetadata) -> None:
        metadata.backend_data = plan_paged_kv(metadata)

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
        plan: FlashInferPlan = metadata.backend_data
        key_cache, _ = kv_cache
        query = query.to(key_cache.dtype)
        if self._planned is not plan:
            # NOTE: the wrappers are planned on the first layer of a step, where the dtype
            # and device are known; every later layer of the step reuses the plan.
            self._plan_wrappers(plan, query.dtype, query.device, key_cache.shape[1])
            self._planned = plan
        decode_wrapper, prefill_wrapper = self._wrappers(query.device)
        output = torch.empty_like(query)
        if plan.num_decodes:
            output[plan.decode_rows] = decode_wrapper.run(query[plan.decode_rows], kv_cache)
        if plan.num_prefill_rows:
            output[plan.prefill_rows] = prefill_wrapper.run(query[plan.prefill_rows], kv_cache)
        return output
