"""The attention kernels of the CPU library (pagoda.native: csrc/paged_attention.c and
csrc/tile_attention.c): writing K/V into the paged cache, paged attention, attention of a shared
prefix and of prefill chunks on tiles, and which tiles this CPU runs."""

from __future__ import annotations

import functools
import logging

import torch

from pagoda.native.library import _kernel, available, cpu_flags, load
from pagoda.native.linear import packed_linear_amx_available

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# fp8 caches: the kernels decode a byte through float16 bits, which for e4m3 are worth 2^-8 of
# its value (csrc/paged_attention.c); the factor goes into the scales.
_FP8_SUFFIX = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_FP8_FACTOR = {torch.float8_e4m3fn: 256.0, torch.float8_e5m2: 1.0}

logger = logging.getLogger(__name__)
logger = logging.getLogger(__name__)


def supports(dtype: torch.dtype) -> bool:
    return dtype in _SUFFIX


def supports_cache(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the kernels attend ``query_dtype`` queries over a ``cache_dtype`` cache: the
    query's own dtype, or fp8."""
    return query_dtype in _SUFFIX and (cache_dtype == query_dtype or cache_dtype in _FP8_SUFFIX)


def write_kv(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor) -> None:
    """Writes each token's key and value into its cache slot (a negative slot is skipped).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim] in the cache's dtype; views with any
            stride between tokens (as of a qkv product) are read in place.
        slot_mapping: int64 [num_tokens]: block_id * block_size + offset.
        key_cache: [num_blocks, num_kv_heads, head_dim, block_size] (keys transposed per block).
        value_cache: [num_blocks, num_kv_heads, block_size, head_dim].
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    key, value = _tokens_apart(key), _tokens_apart(value)
    assert slot_mapping.is_contiguous()
    assert key.dtype == value.dtype == key_cache.dtype == value_cache.dtype and slot_mapping.dtype == torch.int64
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    # NOTE: an fp8 cache takes the bytes of keys and values already converted.
    fn = _kernel("paged_write_kv_" + ("u8" if key_cache.dtype in _FP8_SUFFIX else _SUFFIX[key_cache.dtype]))
    fn(key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
       num_tokens, num_kv_heads, head_dim, value_cache.shape[2], key.stride(0), value.stride(0))


def _tokens_apart(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_dim] with each token's heads contiguous (a copy only where they are not)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, return_lse: bool = False, skip: torch.Tensor | None = None,
                    window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of every query row over its request's paged context.

    Request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]``, the last of its
    ``seq_lens[i]`` positions; a row at position p attends to keys 0..p (within a window,
    p - window + 1..p: the blocks wholly before are never read). Decodes are requests with
    one row.

    Args:
        query: [num_tokens, num_heads, head_dim], contiguous.
        key_cache: [num_blocks, num_kv_heads, head_dim, block_size] (keys transposed per block),
            in the query's dtype or fp8 (scale 1).
        value_cache: [num_blocks, num_kv_heads, block_size, head_dim], as key_cache.
        block_tables: int32 [num_reqs, >= max blocks], rows contiguous (a view that starts
            some blocks in attends over the keys from there on: positions count from it).
        seq_lens: int32 [num_reqs] context lengths (the step's tokens included).
        query_start_loc: int32 [num_reqs + 1].
        scale: Softmax scale.
        return_lse: Also return each row's log-sum-exp of its scaled scores (float32
            [num_tokens, num_heads]), to merge with attention over other keys.
        skip: None, or bool [num_reqs]: requests whose rows another kernel computes (their
            output rows are left unwritten).
        window: None, or the number of keys a row sees (itself included: Mistral's and
            Gemma's sliding windows).
        softcap: None, or the cap of the scaled scores: ``softcap * tanh(score / softcap)``
            (Gemma 2).

    Returns:
        [num_tokens, num_heads, head_dim] in the query's dtype (and the log-sum-exp).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, _, block_size = key_cache.shape
    num_reqs = seq_lens.shape[0]
    assert query.is_contiguous() and block_tables.stride(1) == 1 and seq_lens.is_contiguous()
    assert query_start_loc.is_contiguous() and query_start_loc.shape[0] == num_reqs + 1
    assert key_cache.dtype == value_cache.dtype and supports_cache(query.dtype, key_cache.dtype)
    factor = _FP8_FACTOR.get(key_cache.dtype)
    name = "paged_attention_" + _SUFFIX[query.dtype] + ("" if factor is None else "_" + _FP8_SUFFIX[key_cache.dtype])
    fn = _kernel(name)
    assert block_tables.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
    out = torch.empty_like(query)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32) if return_lse else None
    if skip is not None:
        assert skip.dtype == torch.bool and skip.shape == (num_reqs,) and skip.is_contiguous()
    fn(query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
       block_tables.stride(0), seq_lens.data_ptr(), query_start_loc.data_ptr(), out.data_ptr(),
       None if lse is None else lse.data_ptr(), None if skip is None else skip.data_ptr(), num_reqs, num_heads,
       num_kv_heads, head_dim, block_size, scale * (factor or 1.0), factor or 1.0, window or 0, softcap or 0.0)
    return (out, lse) if return_lse else out


def shared_prefix_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            blocks: torch.Tensor, own_out: torch.Tensor, own_lse: torch.Tensor,
                            scale: float, tiles: str, members: torch.Tensor | None = None,
                            query_start_loc: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every query row (or every row of the ``members``) against the keys of ``blocks`` (a
    prefix those requests share and all their rows come after), merged with each row's
    attention over its own keys, on ``tiles`` (attention_tiles(); csrc/tile_attention.c).

    Args:
        query: [num_tokens, num_heads, head_dim] bfloat16 (or float32, on "avx2" only),
            contiguous.
        key_cache, value_cache: As for paged_attention, in the query's dtype.
        blocks: int32 [n] the prefix's block ids.
        own_out, own_lse: paged_attention's output and log-sum-exp over each row's own keys.
        scale: Softmax scale.
        tiles: "amx", "avx512_bf16" or "avx2".
        members: None (every request), or int32 [n] the requests whose rows share the prefix
            (the others' rows are left unwritten); with query_start_loc (int32 [num_reqs + 1]).
        out: Where to write (a new tensor if None).

    Returns:
        [num_tokens, num_heads, head_dim] in the query's dtype, or None where the kernel does
        not run (that kind of tiles not here or not for float32; head_dim not 64 or 128; no
        memory).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, _, block_size = key_cache.shape
    assert query.dtype == key_cache.dtype == value_cache.dtype == own_out.dtype
    assert query.is_contiguous() and own_out.is_contiguous() and own_lse.is_contiguous()
    assert blocks.dtype == torch.int32 and blocks.is_contiguous() and own_lse.dtype == torch.float32
    if members is not None:
        assert members.dtype == query_start_loc.dtype == torch.int32
        assert members.is_contiguous() and query_start_loc.is_contiguous()
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.dtype == query.dtype and out.is_contiguous()
    failed = _kernel(f"shared_prefix_attention_{_TILE_DTYPES[query.dtype]}")(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), blocks.data_ptr(), blocks.shape[0],
        block_size, num_tokens, None if members is None else members.data_ptr(),
        0 if members is None else members.shape[0], None if members is None else query_start_loc.data_ptr(),
        num_heads, num_kv_heads, head_dim, scale, own_out.data_ptr(), own_lse.data_ptr(), out.data_ptr(),
        tiles_kind(tiles))
    return None if failed else out


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      requests: torch.Tensor, scale: float, out: torch.Tensor, tiles: str) -> bool:
    """The causal attention of the listed requests' query rows (prefill chunks) over their
    contexts, on ``tiles`` (attention_tiles(); csrc/tile_attention.c), written into their
    rows of ``out``.

    Args:
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc: As for
            paged_attention (bfloat16, or float32 on "avx2" only).
        requests: int32 [n] the requests to compute.
        scale: Softmax scale.
        out: [num_tokens, num_heads, head_dim] in the query's dtype, contiguous.
        tiles: "amx", "avx512_bf16" or "avx2".

    Returns:
        Whether it ran (False where the kernel does not: that kind of tiles not here or not
        for float32; head_dim not 64 or 128; no memory).
    """
    _, num_heads, head_dim = query.shape
    _, num_kv_heads, _, block_size = key_cache.shape
    assert query.dtype == key_cache.dtype == value_cache.dtype == out.dtype
    assert query.is_contiguous() and out.is_contiguous() and block_tables.stride(1) == 1
    assert requests.dtype == torch.int32 and requests.is_contiguous()
    failed = _kernel(f"prefill_attention_{_TILE_DTYPES[query.dtype]}")(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), query_start_loc.data_ptr(), requests.data_ptr(),
        requests.shape[0], num_heads, num_kv_heads, head_dim, block_size, scale, out.data_ptr(), tiles_kind(tiles))
    return not failed


# The entry points' suffix per dtype (float32 runs on the "avx2" tiles alone).
_TILE_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}

# NOTE: in the order of tile_attention.c's `kind` argument.
TILE_KINDS = ("avx512_bf16", "amx", "avx2")


def tiles_kind(tiles: str) -> int:
    """tile_attention.c's `kind` argument for a kind of tiles."""
    if tiles not in TILE_KINDS:
        raise ValueError(f"tiles must be one of {TILE_KINDS}, not {tiles!r}")
    return TILE_KINDS.index(tiles)


@functools.cache
def attention_tile_kinds() -> tuple[str, ...]:
    """Every kind of tiles csrc/tile_attention.c runs here (prefill chunks and a shared prefix:
    many query rows against one set of keys), the faster first: "amx" where AMX tiles run,
    "avx512_bf16" where the library was built for AVX512-BF16 (its dot products on 16 rows in
    vector registers), "avx2" where it was built for AVX2 with FMA (float32 products on
    operands widened once; in AVX-512 builds too, where the vector tiles come first, unmeasured
    against them). Cached: tests that want another answer patch attention_tiles(),
    not packed_linear_amx_available()."""
    if not available():
        return ()
    kinds = ("amx",) if packed_linear_amx_available() else ()
    kinds += ("avx512_bf16",) if load().tile_attention_vector_available() else ()
    return kinds + (("avx2",) if load().tile_attention_float_available() else ())


def attention_tiles() -> str | None:
    """The tiles the cpu_paged backend uses here (the first of attention_tile_kinds()), or None:
    the paged kernel takes every row. NOTE: not the float32 tiles on a CPU with AVX-512 (Intel
    Skylake-SP to Ice Lake, without AVX512-BF16): measured on AVX2-only CPUs alone, they stay a
    kind that the tests run there."""
    kinds = [kind for kind in attention_tile_kinds() if kind != "avx2" or "avx512f" not in cpu_flags().split()]
    return kinds[0] if kinds else None


# -- the bfloat16 linear layer (csrc/packed_linear.c) ---------------------------------------

