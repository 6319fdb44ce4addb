"""Cascade attention in cpu_paged (attention_backends/cpu_paged.py): a prefix every request of a
step shares is attended once for all rows, merged with each request's own keys by log-sum-exp."""

import os
import subprocess
import sys

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.attention_backends import cpu_kernels, cpu_paged
from pagoda.native import library as kernel_library
from pagoda.attention_backends.base import AttentionMetadata
from helpers import run_step

pytestmark = pytest.mark.skipif(not kernel_library.available(), reason="needs the CPU kernels (a C compiler)")


@pytest.fixture
def always_cascade(monkeypatch):
    """Cascade for any shared block, so that small steps take it."""
    monkeypatch.setattr(cpu_paged, "CASCADE_MIN_REQUESTS", 1)
    monkeypatch.setattr(cpu_paged, "CASCADE_MIN_TOKENS", 1)


def metadata_of(tables, seq_lens, query_lens, block_size=16):
    width = max(map(len, tables))
    return AttentionMetadata(
        num_tokens=sum(query_lens), query_lens=query_lens, seq_lens=seq_lens,
        query_start_loc=torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64), block_size=block_size,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))


def test_the_shared_prefix_is_the_whole_blocks_every_request_starts_with_before_its_queries():
    tables = [[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 3, 4]]
    shared = cpu_paged.find_shared_prefix(metadata_of(tables, [60, 60, 60], [1, 1, 1]), 1, 1)
    assert shared.blocks.tolist() == [7, 8] and shared.tokens == 32
    assert shared.suffix_seq_lens.tolist() == [28, 28, 28]
    assert shared.suffix_tables[:, :2].tolist() == [[9, 1], [9, 2], [3, 4]]
    # A request whose query rows start inside block 8 sees only block 7 from all its rows.
    assert cpu_paged.find_shared_prefix(metadata_of(tables, [60, 60, 30], [1, 1, 10]), 1, 1).tokens == 16
    # Too few requests or too few shared tokens: no cascade.
    assert cpu_paged.find_shared_prefix(metadata_of(tables, [60, 60, 60], [1, 1, 1]), 4, 1) is None
    assert cpu_paged.find_shared_prefix(metadata_of(tables, [60, 60, 60], [1, 1, 1]), 1, 33) is None
    assert cpu_paged.find_shared_prefix(metadata_of([[1, 2], [3, 2]], [30, 30], [1, 1]), 1, 1) is None
    # A threshold of 0 tokens still needs a whole block before every request's rows.
    assert cpu_paged.find_shared_prefix(metadata_of(tables, [60, 60, 60], [1, 1, 1]), 1, 0).tokens == 32
    assert cpu_paged.find_shared_prefix(metadata_of(tables, [60, 60, 60], [50, 1, 1]), 1, 0) is None


def test_with_subsets_the_largest_group_starting_with_one_block_shares_where_not_every_request_does():
    tables = [[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 3, 4], [5, 6, 10, 11], [5, 6, 12, 13]]
    # A step's first request computes the prompt whose blocks the others found cached: its rows
    # see no whole block before them, so it is no member; without subsets, no cascade at all.
    seq_lens, query_lens = [60, 60, 60, 40, 40], [60, 1, 1, 1, 1]
    assert cpu_paged.find_shared_prefix(metadata_of(tables, seq_lens, query_lens), 2, 1) is None
    shared = cpu_paged.find_shared_prefix(metadata_of(tables, seq_lens, query_lens), 2, 1, subsets=True)
    assert shared.members.tolist() == [1, 2] and shared.blocks.tolist() == [7, 8] and shared.tokens == 32
    assert shared.others.tolist() == [True, False, False, True, True]
    assert shared.suffix_seq_lens[1:3].tolist() == [28, 28] and shared.suffix_tables[1, :2].tolist() == [9, 2]
    # Two system prompts: both groups, the larger first; at a tie, the first block met first.
    seq_lens, query_lens = [60, 60, 60, 40, 40], [1] * 5
    groups = cpu_paged.find_shared_prefixes(metadata_of(tables, seq_lens, query_lens), 2, 1, subsets=True)
    assert [(g.members.tolist(), g.blocks.tolist()) for g in groups] == [([0, 1, 2], [7, 8]), ([3, 4], [5, 6])]
    assert groups[1].others.tolist() == [True, True, True, False, False]
    assert cpu_paged.find_shared_prefix(metadata_of(tables, seq_lens, query_lens), 2, 1, subsets=True) is not None
    assert len(cpu_paged.find_shared_prefixes(metadata_of(tables, seq_lens, query_lens), 3, 1, subsets=True)) == 1
    shared = cpu_paged.find_shared_prefix(metadata_of(tables[1:], seq_lens[1:], query_lens[1:]), 2, 1, subsets=True)
    assert shared.members.tolist() == [0, 1] and shared.blocks.tolist() == [7, 8]
    # The thresholds hold for the group: too few members, or too few tokens they share.
    assert cpu_paged.find_shared_prefix(metadata_of(tables, seq_lens, query_lens), 4, 1, subsets=True) is None
    assert cpu_paged.find_shared_prefix(metadata_of(tables, seq_lens, query_lens), 2, 33, subsets=True) is None
    # Every request sharing: the cascade of all, as without subsets (no members listed).
    shared = cpu_paged.find_shared_prefix(metadata_of(tables[:3], [60] * 3, [1] * 3), 2, 1, subsets=True)
    assert shared.members is None and shared.others is None and shared.tokens == 32


def test_beside_a_cascade_of_members_the_others_chunks_go_to_the_tiles(monkeypatch):
    monkeypatch.setattr(cpu_paged, "CASCADE_MIN_REQUESTS", 2)  # (a group of one takes none)
    monkeypatch.setattr(cpu_paged, "CASCADE_MIN_TOKENS", 1)
    monkeypatch.setattr(cpu_kernels, "attention_tiles", lambda: "amx")
    backend = cpu_paged.CpuPagedAttentionBackend(6, 2, 64, 0.125)
    tables = [[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 3, 4], [5, 6, 10, 11]]
    metadata = metadata_of(tables, [60, 60, 60, 40], [60, 1, 20, 1])
    backend.prepare(metadata)
    plan = metadata.backend_data
    assert plan.shared.members.tolist() == [1, 2]
    assert plan.tile_requests.tolist() == [0]  # a member's chunk goes to the cascade, not the tiles
    assert plan.skip.tolist() == [True, True, True, False]  # the paged kernel: the other decode alone
    metadata = metadata_of(tables, [60, 60, 60, 40], [1, 1, 1, 1])
    metadata.block_tables[0, 0] = 9  # an odd one out among decodes
    backend.prepare(metadata)
    plan = metadata.backend_data
    assert plan.shared.members.tolist() == [1, 2] and plan.tile_requests is None
    assert plan.skip.tolist() == [False, True, True, False]
    # Two groups: each a cascade of its own, the paged kernel none of their rows.
    tables.append([5, 6, 12, 13])
    metadata = metadata_of(tables, [60, 60, 60, 40, 40], [1, 1, 1, 1, 1])
    backend.prepare(metadata)
    plan = metadata.backend_data
    assert [g.members.tolist() for g in plan.groups] == [[0, 1, 2], [3, 4]]
    assert plan.tile_requests is None and plan.skip.all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_log_sum_exp_is_each_rows(dtype):
    block_size, heads, kv_heads, head_dim = 16, 6, 2, 64
    seq_lens, query_lens = [300, 40, 17], [1, 40, 3]  # a decode, a prefill, a chunk over context
    gen = torch.Generator().manual_seed(1)
    blocks = sum(-(-s // block_size) for s in seq_lens)
    keys = torch.randn(blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    values = torch.randn(blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    key_cache = keys.view(blocks, block_size, kv_heads, head_dim).permute(0, 2, 3, 1).contiguous()
    value_cache = values.view(blocks, block_size, kv_heads, head_dim).transpose(1, 2).contiguous()
    tables, first = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(list(range(first, first + n)))
        first += n
    meta = metadata_of(tables, seq_lens, query_lens)
    query = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
    _, lse = cpu_kernels.paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens_tensor,
                                         meta.query_start_loc, 0.125, return_lse=True)
    row = 0
    for table, s, q in zip(tables, seq_lens, query_lens):
        k = keys[table[0] * block_size : table[0] * block_size + s].float()  # [s, kv, d]
        for j in range(q):
            position = s - q + j
            scores = torch.einsum("hd,khd->hk", query[row].float(),
                                  k[: position + 1].repeat_interleave(heads // kv_heads, dim=1)) * 0.125
            torch.testing.assert_close(lse[row], torch.logsumexp(scores, -1), rtol=1e-4, atol=1e-4)
            row += 1


# Requests sharing 1, 2 and 64 ways; prefixes of one block, across the kernel's 256-key
# partitions (17 blocks of 16 = 272 keys) and of many blocks; decodes, and chunks after the prefix.
CASES = [
    (1, [40], [1]),
    (2, [70, 33], [1, 1]),
    (17, [300, 290, 400], [1, 5, 1]),
    (4, [64 + 5 + i % 7 for i in range(64)], [1] * 64),
]


# The shared part in bfloat16: on each kind of tiles (csrc/tile_attention.c) that runs here,
# and by torch's flash attention everywhere; in float32 by torch and on AVX2's float32 tiles.
PATHS = [(torch.float32, "torch"), (torch.bfloat16, "torch")]
PATHS += [(torch.bfloat16, kind) for kind in cpu_kernels.attention_tile_kinds()]
PATHS += [(torch.float32, "avx2")] * ("avx2" in cpu_kernels.attention_tile_kinds())


@pytest.mark.parametrize("shared_blocks,seq_lens,query_lens", CASES)
@pytest.mark.parametrize("dtype,shared_path", PATHS)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (2, 128)])
@pytest.mark.parametrize("block_size", [16, 1, 32])
def test_cascade_matches_naive(always_cascade, monkeypatch, shared_blocks, seq_lens, query_lens, dtype, group,
                               head_dim, shared_path, block_size):
    monkeypatch.setattr(cpu_kernels, "attention_tiles", lambda: None if shared_path == "torch" else shared_path)
    ran, shared_prefix_attention = [], cpu_kernels.shared_prefix_attention
    monkeypatch.setattr(cpu_kernels, "shared_prefix_attention",
                        lambda *a: ran.append(shared_prefix_attention(*a)) or ran[-1])
    # The cases' prefixes in blocks of 16; in blocks of 1 one token short of that (not whole
    # groups of 16 keys), in blocks of 32 half as many blocks (at least one).
    shared_blocks = {16: shared_blocks, 1: shared_blocks * 16 - 1, 32: max(1, shared_blocks // 2)}[block_size]
    shape = dict(num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, shared_blocks=shared_blocks, seed=5,
                 dtype=dtype)
    naive, reference = run_step("naive", block_size, seq_lens, query_lens, **shape)
    out, _ = run_step("cpu_paged", block_size, seq_lens, query_lens, **shape)
    if shared_path != "torch":
        assert ran and all(r is not None for r in ran)  # the tiles ran, not torch in their place
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), naive.float(), **tolerance)
    if dtype == torch.float32:
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)


# A cascade of the members only: the first request computes the whole prompt (its rows, with
# no whole block before them, on the prefill tiles), three share its 17 blocks (across the
# kernel's 256-key partitions), two more stand apart (a decode, a chunk), each a group of one.
@pytest.mark.parametrize("dtype,tiles", [(torch.bfloat16, kind) for kind in cpu_kernels.attention_tile_kinds()]
                         + [(torch.float32, "avx2")] * ("avx2" in cpu_kernels.attention_tile_kinds()))
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (2, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_a_cascade_of_some_requests_matches_naive(always_cascade, monkeypatch, dtype, tiles, group, head_dim,
                                                  block_size):
    monkeypatch.setattr(cpu_kernels, "attention_tiles", lambda: tiles)
    monkeypatch.setattr(cpu_paged, "PREFILL_ON_TILES_MIN_TOKENS", 16)
    members, shared_prefix_attention = [], cpu_kernels.shared_prefix_attention
    def spy(*args):
        out = shared_prefix_attention(*args)
        members.append(None if args[8] is None or out is None else args[8].tolist())
        return out
    monkeypatch.setattr(cpu_kernels, "shared_prefix_attention", spy)
    shared_blocks = {16: 17, 32: 8}[block_size]
    seq_lens, query_lens = [280, 300, 290, 400, 35, 60], [280, 1, 5, 1, 1, 20]
    shape = dict(num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, shared_blocks=shared_blocks, seed=6,
                 dtype=dtype, apart=(4, 5))
    naive, reference = run_step("naive", block_size, seq_lens, query_lens, **shape)
    out, _ = run_step("cpu_paged", block_size, seq_lens, query_lens, **shape)
    # The tiles ran for the members, once; with thresholds of one request, each of the two
    # apart is a group of its own (over its own first blocks).
    assert members == [[1, 2, 3], [4], [5]]
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), naive.float(), **tolerance)
    if dtype == torch.float32:
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)


def test_a_step_takes_the_cascade_only_past_its_thresholds():
    # The thresholds as shipped: on AMX tiles and AVX2's float32 tiles 8 requests over 256 shared
    # tokens, on the vector tiles 32 over 256, by torch 32 over 512 where that pays, and never by
    # torch where it does not (it lost on AMD Zen 5).
    assert cpu_paged.cascade_thresholds("amx", torch_pays=True) == (8, 256)
    assert cpu_paged.cascade_thresholds("avx2", torch_pays=True) == (8, 256)
    assert cpu_paged.cascade_thresholds("avx512_bf16", torch_pays=False) == (32, 256)
    assert cpu_paged.cascade_thresholds(None, torch_pays=True) == (32, 512)
    assert cpu_paged.cascade_thresholds(None, torch_pays=False)[0] == 10**9
    tables = [list(range(32)) + [100 + i] for i in range(32)]
    thresholds = cpu_paged.cascade_thresholds(None, torch_pays=True)
    never = cpu_paged.cascade_thresholds(None, torch_pays=False)
    assert cpu_paged.find_shared_prefix(metadata_of(tables, [520] * 32, [1] * 32), *never) is None
    assert cpu_paged.find_shared_prefix(metadata_of(tables, [520] * 32, [1] * 32), *thresholds).tokens == 512
    assert cpu_paged.find_shared_prefix(metadata_of(tables[:31], [520] * 31, [1] * 31), *thresholds) is None
    one_apart = tables[:31] + [tables[31][:31] + [99, 131]]  # shares 31 blocks: 496 tokens
    assert cpu_paged.find_shared_prefix(metadata_of(one_apart, [520] * 32, [1] * 32), *thresholds) is None


def test_the_cascade_by_torch_pays_with_amx_and_on_cpus_without_avx512(monkeypatch):
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: "flags : fpu sse2 avx2 fma f16c avx512f avx512bw\n")
    assert cpu_paged.cascade_by_torch_pays(amx_runs=True)
    assert not cpu_paged.cascade_by_torch_pays(amx_runs=False)  # AMD Zen 5: lost
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: "flags : fpu sse2 avx2 fma f16c\n")
    assert cpu_paged.cascade_by_torch_pays(amx_runs=False)  # AVX2 only (AMD Zen 3): paid


def test_the_thresholds_come_from_the_environment_of_the_worker():
    code = ("from pagoda.attention_backends import cpu_paged as c; "
            "print(*c.cascade_thresholds('amx', True), *c.cascade_thresholds(None, False), "
            "*c.cascade_thresholds('avx512_bf16', False))")
    env = dict(os.environ, PAGODA_CASCADE_MIN_REQUESTS="3", PAGODA_CASCADE_MIN_TOKENS="48")
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split() == ["3", "48"] * 3
    env["PAGODA_CASCADE_MIN_REQUESTS"] = "0"  # off
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split()[0] == str(10**9)
    # One variable alone: the other keeps its value, by torch too where that is off by default.
    env = dict(os.environ, PAGODA_CASCADE_MIN_REQUESTS="5")
    env.pop("PAGODA_CASCADE_MIN_TOKENS", None)
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split() == ["5", "256", "5", "512", "5", "256"]


def test_generation_over_a_shared_prefix_is_the_same_with_and_without_cascade(tiny_llama_dir, monkeypatch):
    # The worker (a process of its own) reads the thresholds from the environment it inherits.
    # NOTE: float32: in bfloat16 this random model's greedy tokens follow the rounding, and the
    # cascade rounds the shared part's output once more before the merge.
    prefix = [11 + i % 50 for i in range(70)]
    prompts = [prefix + [200 + i, 300 + i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = {}
    for cascade in (False, True):
        monkeypatch.setenv("PAGODA_CASCADE_MIN_REQUESTS", "2" if cascade else "0")
        monkeypatch.setenv("PAGODA_CASCADE_MIN_TOKENS", "16")
        with LLM(str(tiny_llama_dir), max_model_len=128, num_kv_blocks=64, block_size=16, enforce_eager=True,
                 dtype="float32", attention_backend="cpu_paged", async_scheduling=False) as llm:
            llm.generate([prompts[0]], params)  # the prefix into the cache: later requests share its blocks
            results[cascade] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert results[True] == results[False]


def test_batch_invariance_keeps_every_row_on_the_vector_kernel(always_cascade):
    # Whether a row would take the tiles or the cascade depends on its chunking and its step.
    backend = cpu_paged.CpuPagedAttentionBackend(6, 2, 64, 0.125)
    tables = [[7, 8, 9, 1], [7, 8, 9, 2]]
    metadata = metadata_of(tables, [60, 60], [20, 1])
    backend.prepare(metadata)
    assert metadata.backend_data.shared is not None
    backend.batch_invariant = True
    backend.prepare(metadata)
    plan = metadata.backend_data
    assert plan.shared is None and plan.tile_requests is None and plan.skip is None
