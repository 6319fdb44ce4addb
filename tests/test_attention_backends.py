"""Paged attention backends against a dense reference and against the naive backend."""

import os

import numpy as np
import pytest
import torch

from pagoda.attention_backends import AttentionMetadata, get_attention_backend
from helpers import MIXED, WIDE, run_step

@pytest.mark.parametrize("backend", ["naive", "torch_sdpa", "cpu_paged"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seq_lens,query_lens", MIXED)
def test_backend_matches_dense_attention(backend, block_size, seq_lens, query_lens):
    out, reference = run_step(backend, block_size, seq_lens, query_lens)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu_paged"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backend_matches_naive_in_half_precision(backend, block_size, dtype):
    seq_lens, query_lens = [12, 30, 7, 40, 1], [12, 1, 3, 1, 1]
    naive, _ = run_step("naive", block_size, seq_lens, query_lens, seed=3, dtype=dtype)
    out, _ = run_step(backend, block_size, seq_lens, query_lens, seed=3, dtype=dtype)
    torch.testing.assert_close(out.float(), naive.float(), rtol=2e-2, atol=2e-2)


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match="naive"):
        get_attention_backend("nope", torch.device("cpu"))


def test_loading_the_cpu_kernels_keeps_subnormal_floats():
    from pagoda.native import library as kernel_library

    if not kernel_library.available():
        pytest.skip("no C compiler for the CPU kernels")
    # NOTE: a library linked with -ffast-math turns on flush-to-zero for the whole process.
    assert (torch.tensor(1e-40, dtype=torch.float32) * 1).item() != 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kv_write_reads_keys_and_values_in_place_from_the_qkv_product(dtype):
    """Keys and values as views of a qkv product's rows (tokens qkv_size apart) land in their
    slots as contiguous copies would, a negative slot is skipped, and nothing else is written."""
    from pagoda.attention_backends import cpu_kernels
    from pagoda.native import library as kernel_library

    if not kernel_library.available():
        pytest.skip("no C compiler for the CPU kernels")
    tokens, kv_heads, head_dim, block_size, q_size = 7, 3, 16, 4, 96
    qkv = torch.randn(tokens, q_size + 2 * kv_heads * head_dim).to(dtype)
    key, value = (part.view(tokens, kv_heads, head_dim) for part in qkv[:, q_size:].chunk(2, dim=1))
    assert not key.is_contiguous() and key.stride(0) == qkv.shape[1]
    slots = torch.tensor([5, 0, 13, -1, 2, 22, 9])
    caches = []
    for k, v in ((key, value), (key.contiguous(), value.contiguous())):
        key_cache = torch.zeros(6, kv_heads, head_dim, block_size, dtype=dtype)
        value_cache = torch.zeros(6, kv_heads, block_size, head_dim, dtype=dtype)
        cpu_kernels.write_kv(k, v, slots, key_cache, value_cache)
        caches.append((key_cache, value_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    key_cache, value_cache = caches[0]
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            assert torch.equal(value_cache[block, :, offset], value[token])
            assert torch.equal(key_cache[block, :, :, offset], key[token])
    assert int((value_cache != 0).any(-1).sum()) == 6 * kv_heads  # the skipped token wrote nothing


def test_auto_picks_the_cpu_kernel_backend_on_the_cpu():
    from pagoda.native import library as kernel_library

    expected = "cpu_paged" if kernel_library.available() else "torch_sdpa"
    assert get_attention_backend("auto", torch.device("cpu")).name == expected


@pytest.fixture
def triton_interpreter():
    """The triton backend's kernels run under Triton's interpreter here (conftest.py sets it)."""
    pytest.importorskip("triton", reason="the triton package is not installed (pip install 'pagoda[triton]')")
    assert os.environ.get("TRITON_INTERPRET") == "1"


# Prefill from scratch, a decode, a chunk over a cached prefix, a short prefill, a long decode;
# no length is a multiple of the block sizes.


def backend_matches_naive(backend, block_size, group, head_dim, dtype=torch.float32, cases=WIDE):
    seq_lens, query_lens = cases
    shape = dict(num_heads=2 * group, num_kv_heads=2, head_dim=head_dim)
    naive, _ = run_step("naive", block_size, seq_lens, query_lens, seed=7, dtype=dtype, **shape)
    out, _ = run_step(backend, block_size, seq_lens, query_lens, seed=7, dtype=dtype, **shape)
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), naive.float(), **tolerance)


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu_paged"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_backends_match_naive(backend, block_size, group, head_dim):
    backend_matches_naive(backend, block_size, group, head_dim)


@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (1, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_paged_decode_over_many_large_blocks(block_size, group, head_dim, dtype):
    # Decodes whose contexts cross several blocks of every size and end mid-block (the vector
    # kernel walks a block 16 tokens at a time), beside a prefill.
    long_contexts = ([300, 129, 17, 256, 40], [1, 1, 1, 1, 40])
    backend_matches_naive("cpu_paged", block_size, group, head_dim, dtype, cases=long_contexts)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_paged_softmax_over_several_partitions(block_size, dtype):
    # The vector kernel takes its softmax in partitions of 256 keys: a chunk inside the third
    # partition, one whose tile of positions 511-512 (2 tokens x 3 heads) straddles the
    # boundary at 512 (the row at 511 sees nothing of the third partition), a decode one key
    # into the third, one just past the first, and a prefill of 300 tokens.
    contexts = ([600, 531, 513, 257, 300], [40, 40, 1, 1, 300])
    backend_matches_naive("cpu_paged", block_size, 3, 64, dtype, cases=contexts)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_kernels_match_naive_under_the_interpreter(triton_interpreter, block_size, group, head_dim):
    backend_matches_naive("triton", block_size, group, head_dim)


def test_triton_kernels_match_naive_in_bfloat16_under_the_interpreter(triton_interpreter):
    backend_matches_naive("triton", 16, 3, 64, dtype=torch.bfloat16)


DECODES, CHUNKS = ([150, 97, 17, 128, 40], [1, 1, 1, 1, 1]), ([150, 97, 40], [40, 1, 40])


@pytest.mark.parametrize("window,softcap", [(7, None), (1, None), (300, None), (None, 4.0), (23, 4.0)])
@pytest.mark.parametrize("split", [False, True])
def test_triton_windows_and_soft_caps_match_naive_under_the_interpreter(triton_interpreter, monkeypatch, window,
                                                                         softcap, split):
    # Sliding windows (Mistral's, Gemma's) and soft caps (Gemma 2's) as naive runs them: prefill
    # chunks and decodes, a window of one key, one shorter than a block and one longer than every
    # context; split-KV over the window's keys. The blocks before each request's first window hold
    # NaN: a key before a row's window is never read.
    from pagoda.attention_backends import triton_attention

    if split:
        monkeypatch.setattr(triton_attention, "SPLIT_MIN_LEN", 32)
    cases = DECODES if split else WIDE
    shape = dict(num_heads=6, num_kv_heads=2, head_dim=64)
    limits = dict(window=window, softcap=softcap)
    naive, _ = run_step("naive", 16, *cases, seed=5, **shape, **limits)
    out, _ = run_step("triton", 16, *cases, seed=5, **shape, **limits, nan_before_window=window is not None)
    torch.testing.assert_close(out, naive, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("group,cases", [(1, DECODES), (3, DECODES), (8, DECODES), (1, CHUNKS), (3, CHUNKS)],
                         ids=["decodes-1", "decodes-3", "decodes-8", "chunk-decode-prefill-1", "chunk-decode-prefill-3"])
def test_triton_split_kv_matches_naive_under_the_interpreter(triton_interpreter, monkeypatch, group, cases):
    # Four parts of each context (150: 64 keys each, the fourth empty; 97 and 40: 32 each):
    # contexts end mid-part, one (17) inside the first, a chunk whose first rows come before
    # the last parts (they see nothing there).
    from pagoda.attention_backends import triton_attention

    monkeypatch.setattr(triton_attention, "SPLIT_MIN_LEN", 32)
    plan = triton_attention.plan_tiles(cases[1], cases[0], group, 2)
    assert plan.num_splits == 4
    backend_matches_naive("triton", 16, group, 64, cases=cases)
    if group == 3:
        backend_matches_naive("triton", 16, group, 128, dtype=torch.bfloat16, cases=cases)


def test_triton_tiles_pack_a_kv_heads_queries_and_split_only_small_steps():
    from pagoda.attention_backends.triton_attention import MIN_ROWS, plan_tiles

    # Every query of every request in exactly one tile, in order.
    query_lens, seq_lens = [37, 1, 9, 16, 1], [37, 20, 33, 16, 50]
    for group in (1, 2, 3, 7, 8, 16):
        plan = plan_tiles(query_lens, seq_lens, group, 8)
        assert plan.tokens * plan.group_pad >= max(MIN_ROWS, group) and plan.group_pad >= group
        covered = [(r, s + i) for r, s in zip(plan.tile_request, plan.tile_start) for i in range(plan.tokens)
                   if s + i < query_lens[r]]
        assert covered == [(r, i) for r, q in enumerate(query_lens) for i in range(q)]
        assert plan.num_splits == 1  # 50 keys at most: nothing to split
    # One decode over 4096 keys with 8 KV heads: 8 programs, so 16 parts of 256 keys.
    plan = plan_tiles([1], [4096], 4, 8)
    assert (plan.tokens, plan.group_pad, plan.num_splits) == (1, 16, 16)
    # 64 decodes already make 512 programs: no split.
    assert plan_tiles([1] * 64, [4096] * 64, 4, 8).num_splits == 1
    # Parts of at least 256 keys of the longest context: 1000 keys, 3 parts.
    assert plan_tiles([1, 1], [1000, 3], 1, 2).num_splits == 3


def test_flashinfer_plan_describes_every_requests_pages_in_order():
    from pagoda.attention_backends.flashinfer_attention import plan_paged_kv

    block_size = 16
    seq_lens, query_lens = WIDE
    rng = torch.Generator().manual_seed(0)
    perm = torch.randperm(40, generator=rng).tolist()
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[:n])
        perm = perm[n:]
    max_blocks = max(len(t) for t in tables)
    starts = [0] + list(torch.tensor(query_lens).cumsum(0).tolist())
    metadata = AttentionMetadata(
        num_tokens=sum(query_lens), query_lens=query_lens, seq_lens=seq_lens,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [99] * (max_blocks - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64), block_size=block_size,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    plan = plan_paged_kv(metadata)
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    prefills = [i for i, q in enumerate(query_lens) if q != 1]
    assert plan.decode_rows.tolist() == [starts[i] for i in decodes]
    assert plan.prefill_rows.tolist() == [r for i in prefills for r in range(starts[i], starts[i + 1])]
    assert plan.prefill_qo_indptr.tolist() == [0, *torch.tensor([query_lens[i] for i in prefills]).cumsum(0).tolist()]
    for group, kv in ((decodes, plan.decode), (prefills, plan.prefill)):
        assert kv.indptr.dtype == kv.indices.dtype == kv.last_page_len.dtype == torch.int32
        for j, i in enumerate(group):
            pages = kv.indices[kv.indptr[j] : kv.indptr[j + 1]].tolist()
            assert pages == tables[i]  # no padding block, in table order
            last = int(kv.last_page_len[j])
            assert 1 <= last <= block_size and (len(pages) - 1) * block_size + last == seq_lens[i]
    assert plan.prefill_qo_indptr.device.type == kv.indptr.device.type == "cpu"  # plan() reads them there


def test_flashinfer_plan_takes_the_runners_order_as_slices_written_in_place():
    """Decodes first, then the chunks (the model runner's order): both sets of query rows are
    slices, so the wrappers write into the output in place; the host's block tables are
    read, not the device's."""
    from pagoda.attention_backends.flashinfer_attention import plan_paged_kv

    seq_lens, query_lens = [20, 50, 37, 33], [1, 1, 37, 9]
    tables = np.array([[4, 9, 0], [1, 2, 3], [5, 6, 7], [8, 10, 11]], dtype=np.int32)
    metadata = AttentionMetadata(
        num_tokens=48, query_lens=query_lens, seq_lens=seq_lens,
        query_start_loc=torch.tensor([0, 1, 2, 39, 48], dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.full((4, 3), 99, dtype=torch.int32),  # not read
        slot_mapping=torch.zeros(48, dtype=torch.int64), block_size=16, max_query_len=37, max_seq_len=50,
        block_tables_host=tables)
    plan = plan_paged_kv(metadata)
    assert (plan.decode_rows, plan.prefill_rows) == (slice(0, 2), slice(2, 48))
    assert (plan.num_decodes, plan.num_prefill_rows) == (2, 46)
    assert plan.decode.indices.tolist() == [4, 9, 1, 2, 3] and plan.decode.last_page_len.tolist() == [4, 2]
    assert plan.prefill.indices.tolist() == [5, 6, 7, 8, 10, 11] and plan.prefill_qo_indptr.tolist() == [0, 37, 46]


def test_backends_that_cannot_run_say_why():
    with pytest.raises(ValueError, match="CUDA"):
        get_attention_backend("flashinfer", torch.device("cpu"))
    assert "flashinfer" not in [get_attention_backend("auto", torch.device("cpu")).name]


def test_selection_checks_the_models_dtype_head_size_and_group(monkeypatch):
    from pagoda.attention_backends import AUTO_ORDER, SUPPORTED_ATTENTION_BACKENDS, AttentionShape
    from pagoda.attention_backends.flashinfer_attention import FlashInferAttentionBackend, decode_uses_tensor_cores
    from pagoda.attention_backends.naive import NaiveAttentionBackend

    problem = FlashInferAttentionBackend.shape_problem
    assert problem(torch.float32, 64, 8, 2) == "FlashInfer's kernels take float16 and bfloat16, not float32"
    assert problem(torch.bfloat16, 96, 8, 2) == "FlashInfer's kernels take head sizes 64, 128, 256, not 96"
    assert problem(torch.bfloat16, 128, 28, 4) is None  # Qwen2.5-7B: 7 query heads per KV head
    # The plain decode kernel is built for groups 1, 2, 3, 4, 6, 8 and 16; the tensor-core one
    # takes the rest (5, 7: Qwen2.5) and the large groups, where it is faster.
    assert [g for g in range(1, 17) if not decode_uses_tensor_cores(g)] == [1, 2, 3]

    class HalfOnly(NaiveAttentionBackend):
        name = "half_only"

        @classmethod
        def shape_problem(cls, dtype, head_dim, num_heads, num_kv_heads):
            return None if dtype == torch.bfloat16 else "half only"

    monkeypatch.setitem(SUPPORTED_ATTENTION_BACKENDS, "half_only", lambda: HalfOnly)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="'half_only' cannot run this model: half only"):
        get_attention_backend("half_only", cpu, shape=AttentionShape(torch.float32, 64, 8, 2))
    assert get_attention_backend("half_only", cpu, shape=AttentionShape(torch.bfloat16, 64, 8, 2)) is HalfOnly
    monkeypatch.setitem(AUTO_ORDER, "cpu", ("half_only", "naive"))
    assert get_attention_backend("auto", cpu, shape=AttentionShape(torch.float32, 64, 8, 2)).name == "naive"
    assert get_attention_backend("auto", cpu, shape=AttentionShape(torch.bfloat16, 64, 8, 2)) is HalfOnly


def _tile_kinds() -> list[tuple[str, torch.dtype]]:
    """Each kind of tiles that runs here with bfloat16, and the float32 tiles with float32."""
    from pagoda.attention_backends import cpu_kernels

    kinds = cpu_kernels.attention_tile_kinds()
    return ([(kind, torch.bfloat16) for kind in kinds] + [("avx2", torch.float32)] * ("avx2" in kinds)
            or [pytest.param("none", None, marks=pytest.mark.skip(
                reason="the prefill tiles need a build for AVX2 with FMA at least"))])


@pytest.mark.parametrize("tiles,dtype", _tile_kinds())
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (8, 64), (2, 128)])
@pytest.mark.parametrize("min_tokens", [1, 16])
def test_prefill_on_tiles_matches_naive(monkeypatch, tiles, dtype, block_size, group, head_dim, min_tokens):
    # Chunks from scratch and over cached context, crossing the tiles' 16- and 64-key steps and
    # 256-key partitions, beside decodes; with min_tokens 1 every row (decodes too) goes to the
    # tiles. Each kind of tiles that runs here (AMX, AVX512-BF16 vectors, AVX2's float32; those
    # in float32 too).
    from pagoda.attention_backends import cpu_kernels, cpu_paged

    monkeypatch.setattr(cpu_kernels, "attention_tiles", lambda: tiles)
    monkeypatch.setattr(cpu_paged, "PREFILL_ON_TILES_MIN_TOKENS", min_tokens)
    ran, prefill_attention = [], cpu_kernels.prefill_attention
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda *a: ran.append(prefill_attention(*a)) or ran[-1])
    cases = ([300, 17, 600, 1, 70, 33], [300, 17, 40, 1, 1, 16])
    backend_matches_naive("cpu_paged", block_size, group, head_dim, dtype, cases=cases)
    assert ran and all(ran)  # the tiles ran, not the kernel in their place


def kernel_built_for(source: str, march: str, directory, *defines: str):
    """One file of csrc/ alone, built for ``march`` with the library's flags and ``defines``
    ("NAME=VALUE"; seconds), loaded."""
    import ctypes
    import subprocess

    from pagoda.native import library as kernel_library

    target = directory / f"{source}-{march}-{len(defines)}.so"
    flags = [flag for flag in kernel_library._flags() if not flag.startswith("-march=")]
    subprocess.run([kernel_library._compiler(), f"-march={march}", *flags, *(f"-D{d}" for d in defines),
                    f"-I{kernel_library._CSRC}", "-o", str(target), str(kernel_library._CSRC / source), "-lm"], check=True,
                   capture_output=True, timeout=300)
    return ctypes.CDLL(str(target))


def paged_kernel_for(march: str, directory):
    """csrc/paged_attention.c alone, built for ``march``."""
    import ctypes

    lib = kernel_built_for("paged_attention.c", march, directory)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in ("paged_attention_f32", "paged_attention_bf16", "paged_attention_bf16_e4m3"):
        getattr(lib, name).argtypes = [p, p, p, p, i64, p, p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float,
                                       ctypes.c_float, i64, ctypes.c_float]
    return lib


@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])
def test_avx2_and_portable_builds_of_the_paged_kernel_match_this_ones(tmp_path, march):
    """The paged kernel built for an AVX2 CPU (x86-64-v3: the vector tiles on two 8-lane halves,
    their own exp) and for an older one (x86-64-v2: the generic loop) gives this machine's
    build's outputs and log-sum-exps up to float32 rounding: prefill chunks and decodes, block
    sizes 16 and 32, 3 query heads per KV head, a float32, a bfloat16 and an fp8 cache, scores
    spread wide enough that exp sees large negative inputs; without and with a window and a
    soft cap."""
    from pagoda.attention_backends import cpu_kernels
    from pagoda.native import library as kernel_library

    if not kernel_library.available():
        pytest.skip("the CPU kernels cannot be built here")
    lib = paged_kernel_for(march, tmp_path)
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim = 6, 2, 64
    query_lens, seq_lens = [5, 1, 19, 1], [40, 300, 19, 17]
    for block_size in (16, 32):
        blocks_per = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per) + 3
        order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        tables = torch.zeros(len(seq_lens), max(blocks_per), dtype=torch.int32)
        at = 0
        for i, n in enumerate(blocks_per):
            tables[i, :n] = order[at:at + n]
            at += n
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        query = torch.randn(sum(query_lens), heads, head_dim, generator=gen) * 3
        keys = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=gen)
        values = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen)
        for name, q, k, v in (("paged_attention_f32", query, keys, values),
                              ("paged_attention_bf16", query.bfloat16(), keys.bfloat16(), values.bfloat16()),
                              ("paged_attention_bf16_e4m3", query.bfloat16(), keys.to(torch.float8_e4m3fn),
                               values.to(torch.float8_e4m3fn))):
          for window, softcap in ((None, None), (23, 4.0)):
            native, native_lse = cpu_kernels.paged_attention(q, k, v, tables, lens, starts, 0.125, return_lse=True,
                                                             window=window, softcap=softcap)
            out, lse = torch.empty_like(q), torch.empty(q.shape[0], heads)
            factor = 256.0 if k.dtype == torch.float8_e4m3fn else 1.0  # as cpu_kernels.paged_attention passes it
            getattr(lib, name)(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), tables.stride(0),
                               lens.data_ptr(), starts.data_ptr(), out.data_ptr(), lse.data_ptr(), None, len(seq_lens),
                               heads, kv_heads, head_dim, block_size, 0.125 * factor, factor, window or 0,
                               softcap or 0.0)
            tolerance = dict(rtol=1e-4, atol=1e-4) if q.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
            what = f"{name} bs {block_size} window {window}"
            torch.testing.assert_close(out.float(), native.float(), **tolerance, msg=what)
            torch.testing.assert_close(lse, native_lse, rtol=1e-5, atol=1e-5, msg=what)


def _attention_reference(query, keys, values, last, scale, window=None, softcap=None):
    """float32 softmax(q k^T) v of each row (tokens, heads, dims) over keys (kv_heads, n, dims)
    0..last[token] (a causal chunk: last per token; the last ``window`` of them with a window),
    with the heads grouped over the KV heads (and the scores soft-capped with ``softcap``)."""
    group = query.shape[1] // keys.shape[0]
    out = torch.empty(query.shape, dtype=torch.float32)
    for t in range(query.shape[0]):
        first = max(0, last[t] + 1 - window) if window else 0
        k, v = keys[:, first:last[t] + 1].float(), values[:, first:last[t] + 1].float()
        q = query[t].float().view(keys.shape[0], group, -1)
        scores = q @ k.transpose(1, 2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out[t] = (torch.softmax(scores, dim=-1) @ v).reshape(query.shape[1], -1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])  # 8: the generic loop
@pytest.mark.parametrize("group,head_dim", [(3, 64), (1, 128)])
def test_paged_kernel_windows_and_soft_caps(dtype, block_size, group, head_dim):
    """Sliding windows (Mistral's, Gemma's) and soft caps (Gemma 2's) in csrc/paged_attention.c
    against a torch reference: prefill chunks and decodes; windows of one key, shorter than a
    block, across the 256-key partitions, longer than the context. The blocks wholly before
    every row's window hold NaN, as a block given back to the pool and written by another
    request holds anything: the kernel never reads them."""
    from pagoda.attention_backends import cpu_kernels
    from pagoda.native import library as kernel_library

    if not kernel_library.available():
        pytest.skip("the CPU kernels cannot be built here (no C compiler)")
    gen = torch.Generator().manual_seed(5)
    kv_heads = 2
    heads = kv_heads * group
    query_lens, seq_lens = [5, 1, 19, 1, 40, 1], [40, 300, 19, 600, 560, 17]
    blocks_per = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per)
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_per), dtype=torch.int32)
    owned, at = [], 0
    for i, n in enumerate(blocks_per):
        tables[i, :n] = order[at:at + n]
        owned.append(order[at:at + n].long())
        at += n
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = (torch.randn(sum(query_lens), heads, head_dim, generator=gen) * 2).to(dtype)
    clean_keys = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=gen).to(dtype)
    clean_values = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for window in (1, 7, 16, 100, 300, 4096):
        keys, values = clean_keys.clone(), clean_values.clone()
        for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
            first = max(0, n - q + 1 - window)  # the first key of the request's first row
            keys[owned[i][:first // block_size]] = float("nan")
            values[owned[i][:first // block_size]] = float("nan")
        for softcap in (None, 3.0):
            out, lse = cpu_kernels.paged_attention(query, keys, values, tables, lens, starts, scale, return_lse=True,
                                                   window=window, softcap=softcap)
            assert not out.isnan().any() and not lse.isnan().any(), f"window {window}: a block before it was read"
            for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
                k = clean_keys[owned[i]].permute(1, 0, 3, 2).reshape(kv_heads, -1, head_dim)
                v = clean_values[owned[i]].transpose(0, 1).reshape(kv_heads, -1, head_dim)
                rows = slice(int(starts[i]), int(starts[i + 1]))
                expected = _attention_reference(query[rows], k, v, list(range(n - q, n)), scale, window, softcap)
                torch.testing.assert_close(out[rows].float(), expected, **tolerance,
                                           msg=f"request {i}, window {window}, softcap {softcap}")


@pytest.mark.parametrize("march,budget,shape", [("x86-64-v3", None, (6, 2, 64)), ("x86-64-v3", 4096, (6, 2, 64)),
                                                ("x86-64-v2", None, (6, 2, 64)),
                                                # NOTE: a tile of 2 tokens x 2 heads: 4 rows, as a decode's
                                                ("x86-64-v3", None, (4, 2, 128))])
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_avx2_and_portable_builds_of_the_tiles(tmp_path, march, budget, shape, dtype):
    """csrc/tile_attention.c built for an AVX2 CPU (x86-64-v3: the float32 tiles alone; the other
    kinds decline) against a torch reference, for a prefill of two chunks (one over cached
    context, not whole blocks; bit for bit the paged kernel's AVX2 build) and a shared prefix
    merged with each row's own attention; with a
    4 KB packing budget every chunk is a group of its own and each outgrows the budget. Built
    for an older CPU (x86-64-v2) it has no tiles, and every entry point declines."""
    import ctypes

    from pagoda.attention_backends import cpu_kernels
    from pagoda.native import library as kernel_library

    if "avx2" not in cpu_kernels.attention_tile_kinds():
        pytest.skip("this CPU runs no AVX2 build")
    lib = kernel_built_for("tile_attention.c", march, tmp_path, *([f"PACK_BUDGET={budget}"] if budget else []))
    native, suffix = kernel_library.load(), {torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
    prefill, shared = getattr(lib, f"prefill_attention_{suffix}"), getattr(lib, f"shared_prefix_attention_{suffix}")
    for fn, name in ((prefill, "prefill_attention_bf16"), (shared, "shared_prefix_attention_bf16")):
        fn.argtypes, fn.restype = getattr(native, name).argtypes, ctypes.c_int
    for name in ("tile_attention_vector_available", "tile_attention_float_available"):
        getattr(lib, name).restype = ctypes.c_int
    assert lib.tile_attention_vector_available() == 0
    assert lib.tile_attention_float_available() == (march == "x86-64-v3")
    gen = torch.Generator().manual_seed(11)
    (heads, kv_heads, head_dim), block_size, scale = shape, 16, 0.125
    tables = torch.arange(2 * 19, dtype=torch.int32).view(2, 19)
    starts, lens = torch.tensor([0, 37, 57], dtype=torch.int32), torch.tensor([37, 300], dtype=torch.int32)
    listed = torch.tensor([0, 1], dtype=torch.int32)
    query = (torch.randn(57, heads, head_dim, generator=gen) * 3).to(dtype)
    keys = torch.randn(38, kv_heads, head_dim, block_size, generator=gen).to(dtype)
    values = torch.randn(38, kv_heads, block_size, head_dim, generator=gen).to(dtype)

    def call(fn, *args, kind):
        return fn(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args), kind)

    out = torch.zeros_like(query)
    prefill_args = (query, keys, values, tables, tables.stride(0), lens, starts, listed, 2, heads, kv_heads, head_dim,
                    block_size, scale, out)
    # 5 decodes after 3 shared blocks, merged with attention over "their own keys" (random here)
    blocks = torch.tensor([4, 9, 2], dtype=torch.int32)
    own, own_lse = query[:5].clone(), torch.randn(5, heads, generator=gen)
    shared_out = torch.zeros_like(own)
    shared_args = (query, keys, values, blocks, 3, block_size, 5, None, 0, None, heads, kv_heads, head_dim, scale, own,
                   own_lse, shared_out)
    float_tiles = cpu_kernels.tiles_kind("avx2")
    if march == "x86-64-v2":
        assert call(prefill, *prefill_args, kind=float_tiles) and call(shared, *shared_args, kind=float_tiles)
        return
    for other in ("avx512_bf16", "amx"):  # not in this build: declined
        assert call(prefill, *prefill_args, kind=cpu_kernels.tiles_kind(other)) == 1
    assert call(prefill, *prefill_args, kind=float_tiles) == 0
    assert call(shared, *shared_args, kind=float_tiles) == 0

    def context(request):  # [kv_heads, tokens, dims] of a request's blocks
        ids = tables[request].long()
        return keys[ids].permute(1, 0, 3, 2).reshape(kv_heads, -1, head_dim), values[ids].transpose(0, 1).reshape(
            kv_heads, -1, head_dim)

    # The prefill rows bit for bit the paged kernel's of the same build (its AVX2 path): a
    # token's attention is the same whichever of the two takes its chunk.
    paged = paged_kernel_for(march, tmp_path)
    by_kernel = torch.zeros_like(query)
    getattr(paged, f"paged_attention_{suffix}")(
        query.data_ptr(), keys.data_ptr(), values.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        starts.data_ptr(), by_kernel.data_ptr(), None, None, 2, heads, kv_heads, head_dim, block_size, scale, 1.0, 0,
        0.0)
    assert torch.equal(out, by_kernel)
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for request, (first, count) in enumerate(((0, 37), (37, 20))):
        k, v = context(request)
        last = [int(lens[request]) - count + t for t in range(count)]
        torch.testing.assert_close(out[first:first + count].float(),
                                   _attention_reference(query[first:first + count], k, v, last, scale), **tolerance)
    k = keys[blocks.long()].permute(1, 0, 3, 2).reshape(kv_heads, -1, head_dim)
    v = values[blocks.long()].transpose(0, 1).reshape(kv_heads, -1, head_dim)
    common = _attention_reference(query[:5], k, v, [47] * 5, scale)
    # the shared part's log-sum-exp, to merge as the kernel does
    group = heads // kv_heads
    scores = torch.einsum("thd,hkd->thk", query[:5].float().view(5, kv_heads, group, head_dim).reshape(5, heads, -1),
                          k.float().repeat_interleave(group, 0)) * scale
    common_lse = torch.logsumexp(scores, dim=-1)
    weight = torch.sigmoid(common_lse - own_lse).unsqueeze(-1)  # e^a / (e^a + e^b)
    expected = weight * common + (1 - weight) * own.float()
    torch.testing.assert_close(shared_out.float(), expected, **tolerance)


def test_the_float32_tiles_are_the_default_only_without_avx512(monkeypatch):
    # Measured on AVX2-only CPUs alone: an AVX-512 CPU without AVX512-BF16 (Intel Skylake-SP to
    # Ice Lake) keeps the paged kernel, and one with the vector tiles takes those first.
    from pagoda.attention_backends import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "attention_tile_kinds", lambda: ("avx2",))
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: "flags : fpu sse2 avx2 fma f16c\n")
    assert cpu_kernels.attention_tiles() == "avx2"
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: "flags : fpu sse2 avx2 fma f16c avx512f avx512bw\n")
    assert cpu_kernels.attention_tiles() is None
    monkeypatch.setattr(cpu_kernels, "attention_tile_kinds", lambda: ("avx512_bf16", "avx2"))
    assert cpu_kernels.attention_tiles() == "avx512_bf16"


def test_the_gpu_checks_decode_timing_runs_on_the_cpu(capsys):
    """tests/gpu_attention_timing.py (run by run_gpu_checks.sh on a GPU) on the CPU's backends:
    a row of timings per backend that runs, a reason for one that cannot."""
    from gpu_attention_timing import main

    main(["--device", "cpu", "--backends", "naive,cpu_paged,flashinfer", "--batches", "1,3", "--contexts", "40",
          "--iters", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["backend", "1", "x", "40", "3", "x", "40"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert all(float(ms) > 0 for ms in rows["naive"] + rows["cpu_paged"]) and len(rows["naive"]) == 2
    assert "not available" in " ".join(rows["flashinfer"])


def test_host_arrays_reach_the_cpu_device_without_a_copy():
    from pagoda.engine.worker.host_copy import to_device

    array = np.arange(6, dtype=np.int32)
    tensor = to_device(array, torch.device("cpu"))
    assert tensor.data_ptr() == array.ctypes.data  # the hot path on the CPU pays nothing
    assert to_device(array, torch.device("cpu"), torch.long).tolist() == list(range(6))


def test_the_swap_space_is_one_buffer_viewed_per_layer():
    from pagoda.engine.worker.model_runner import allocate_swap_space

    shapes = ((5, 2, 16, 4), (5, 2, 4, 16))  # cpu_paged's: keys transposed within a block
    layers = allocate_swap_space(shapes, 3, torch.bfloat16, pin=False)
    assert len(layers) == 3 and all(tuple(tuple(t.shape) for t in layer) == shapes for layer in layers)
    base = layers[0][0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base and t.is_contiguous() for layer in layers for t in layer)
    # The views tile the buffer without overlap: writing one block of each leaves the others.
    for i, layer in enumerate(layers):
        for j, t in enumerate(layer):
            t.fill_(10 * i + j)
    assert [int(t[4, 1, 3, 3]) for layer in layers for t in layer] == [0, 1, 10, 11, 20, 21]


def test_flashinfer_decode_graph_replans_each_step_into_its_fixed_buffers(monkeypatch):
    """FlashInfer's CUDA-graph decode wrapper, through a stand-in that records the calls (the
    package and a GPU are not here): built over page buffers of the bucket's size, planned
    before each replay from the host's lengths and tables (padding rows: one token of the
    scratch block), run into the output in place."""
    import sys
    import types

    calls = []

    class Wrapper:
        def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False,
                     paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
            if use_cuda_graph:
                calls.append(("init", tuple(paged_kv_indptr_buffer.shape), tuple(paged_kv_indices_buffer.shape),
                              tuple(paged_kv_last_page_len_buffer.shape), use_tensor_cores))

        def plan(self, indptr, indices, last_page_len, **options):
            calls.append(("plan", indptr.tolist(), indices.tolist(), last_page_len.tolist(), options["page_size"],
                          options["q_data_type"]))

        def run(self, query, kv_cache, out=None):
            calls.append(("run", tuple(query.shape), out is not None))
            out.fill_(1)

    flashinfer = types.ModuleType("flashinfer")
    flashinfer.BatchDecodeWithPagedKVCacheWrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper = Wrapper
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    from pagoda.attention_backends.flashinfer_attention import FlashInferAttentionBackend

    backend = FlashInferAttentionBackend(8, 2, 64, 64**-0.5)
    scratch = 9
    metadata = AttentionMetadata(
        num_tokens=4, query_lens=[1] * 4, seq_lens=[64] * 4, query_start_loc=torch.arange(5, dtype=torch.int32),
        seq_lens_tensor=torch.ones(4, dtype=torch.int32), block_tables=torch.full((4, 4), scratch, dtype=torch.int32),
        slot_mapping=torch.full((4,), scratch * 16, dtype=torch.int64), block_size=16, max_query_len=1, max_seq_len=64)
    backend.prepare_decode_graph(metadata, torch.bfloat16)
    assert calls == [("init", (5,), (16,), (4,), True),  # groups of 4 take the tensor-core decode
                     ("plan", [0, 1, 2, 3, 4], [scratch] * 4, [1, 1, 1, 1], 16, torch.bfloat16)]
    tables = np.array([[3, 4, 0, 0], [5, 6, 7, 0], [scratch, 1, 2, 3], [scratch, 8, 8, 8]], dtype=np.int32)
    backend.update_decode_graph(metadata, np.array([20, 33, 1, 1], dtype=np.int32), tables)
    assert calls[-1] == ("plan", [0, 2, 5, 6, 7], [3, 4, 5, 6, 7, scratch, scratch], [4, 1, 1, 1], 16, torch.bfloat16)
    cache = tuple(torch.zeros(10, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    out = backend.forward(torch.randn(4, 8, 64), torch.randn(4, 2, 64), torch.randn(4, 2, 64), cache, metadata)
    assert calls[-1] == ("run", (4, 8, 64), True) and bool((out == 1).all())
