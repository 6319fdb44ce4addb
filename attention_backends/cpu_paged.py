"""The cpu_paged backend: attention by a CPU kernel that reads the KV blocks in place.

Every query row of a step, prefill chunks and decodes alike, goes to the C kernel in
native/csrc/paged_attention.c (built on first use for this CPU, see native/library.py): each
request reads only its own blocks, with no gather into a padded copy, so one long request
among short ones costs only its own length; a prefill chunk is cut into tiles of a few
query tokens, and each tile reads its context once. The step's new keys and values are
written into their slots by the same library. Keys are stored transposed within each
block so the kernel computes a block's scores with vector lanes over the block's tokens.

In bfloat16, prefill chunks of PREFILL_ON_TILES_MIN_TOKENS_BY_KIND tokens or more go to
csrc/tile_attention.c instead: a request's rows of a KV head as one matrix against its
context, on AMX tiles (16 rows by 64 keys a product) where they run, else on AVX512-BF16
vector tiles (16 rows in registers against 16 keys or dimensions a step), else on AVX2's
float32 tiles (operands widened once, 6 rows against 16 keys or dimensions a step).

Cascade attention: when every request of a step starts with the same blocks (a system
prompt or few-shot prefix that the prefix cache shares) and enough requests share enough of
them, the shared keys are attended once for all the step's query rows together (on the same
tiles where they run, float32 on AVX2's too; else in float32 on an AMX CPU and on CPUs
without AVX-512, by torch's CPU flash attention: the rows of every request against one matrix
of keys; not by torch on other CPUs without AMX, where it lost to the kernel alone), and each
request's own keys by the kernel; the two parts merge by their log-sum-exp. The kernel alone
would read the shared blocks once per request (64 requests over a 512-token prefix: 64 passes
over the same keys). One level, as vLLM's GPU cascade: a step whose requests do not all share
the prefix runs as before.

Sliding windows and soft-capped scores (Mistral, Phi-3, Gemma): the layers that have them take
the vector kernel alone (it starts each tile's walk at its first row's window and masks per
row), never the prefill tiles or a cascade; the other layers of the step as above.

Dtypes: bfloat16 and float32 use the kernels; other dtypes (float16) fall back to
torch_sdpa's torch code on the same layout (without windows or soft caps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.environment import read_int
from pagoda.attention_backends import cpu_kernels
from pagoda.native import library as kernel_library
from pagoda.native import linear as linear_kernels
from pagoda.attention_backends.base import FP8_DTYPES, AttentionMetadata, to_cache_dtype
from pagoda.attention_backends.torch_sdpa import SdpaStepData, TorchSdpaAttentionBackend


# The (requests, shared tokens) from which a step takes the cascade, by measurement
# (docs/benchmarks.md, cascade attention): with the shared part on AMX tiles, on AVX512-BF16
# vector tiles (bfloat16 on CPUs without AMX: 1.3-1.5x from 32 requests over 256 tokens on an
# AMD Zen 4, 0.9x at 16), on AVX2's float32 tiles (bfloat16 on an AMD Zen 3: 1.19x at 8 requests
# over 256 tokens, 2.6x at 64 over 512, 1.02x at 8 over 128), and by torch's flash attention
# (float32 on a CPU whose AMX tiles run), whose per-call costs are higher. Below them the
# kernel alone is as fast. NOTE: by torch only where it paid (cascade_by_torch_pays): on the
# Intel Xeon with AMX whose decode waits on memory (64 x 512: 1.18x) and on an AVX2-only AMD
# Zen 3 before its float32 tiles (the 64 x 512 shared-prefix workload 0.93x of the time, four
# pairs of runs, 2026-12-04); it lost in every case on an AMD Zen 5 with AVX-512 and no AMX
# (0.23-0.75x), where the kernel's repeated reads of the prefix come from the caches.
CASCADE_ON_TILES = (8, 256)
CASCADE_ON_VECTOR_TILES = (32, 256)
CASCADE_ON_FLOAT_TILES = (8, 256)
CASCADE_BY_TORCH = (32, 512)
NEVER = (10**9, 10**9)
# NOTE: read where the worker starts; they replace every pair above (for experiments and
# tests; PAGODA_CASCADE_MIN_REQUESTS=0 turns the cascade off).
CASCADE_MIN_REQUESTS = read_int("PAGODA_CASCADE_MIN_REQUESTS")
CASCADE_MIN_TOKENS = read_int("PAGODA_CASCADE_MIN_TOKENS")


def cascade_by_torch_pays(amx_runs: bool) -> bool:
    """Whether the shared part of a cascade by torch's flash attention paid on CPUs like this
    one (measured: where the AMX tiles run, and on CPUs without AVX-512)."""
    return amx_runs or "avx512f" not in kernel_library.cpu_flags().split()


def cascade_thresholds(shared_on: str | None, torch_pays: bool) -> tuple[int, int]:
    """The (requests, shared tokens) from which a step takes the cascade, with its shared part
    on ``shared_on`` tiles ("amx", "avx512_bf16", "avx2"; cpu_kernels.attention_tiles()) or by
    torch (None), on a CPU where the cascade by torch pays or not (cascade_by_torch_pays)."""
    overridden = CASCADE_MIN_REQUESTS is not None or CASCADE_MIN_TOKENS is not None
    # NOTE: an override asks for the cascade even where it is off by default; a variable it
    # leaves unset keeps the value of the path's row (by torch: as where AMX runs).
    if shared_on == "amx":
        requests, tokens = CASCADE_ON_TILES
    elif shared_on == "avx512_bf16":
        requests, tokens = CASCADE_ON_VECTOR_TILES
    elif shared_on == "avx2":
        requests, tokens = CASCADE_ON_FLOAT_TILES
    else:
        requests, tokens = CASCADE_BY_TORCH if torch_pays or overridden else NEVER
    if CASCADE_MIN_REQUESTS is not None:
        requests = CASCADE_MIN_REQUESTS or 10**9  # 0: never
    if CASCADE_MIN_TOKENS is not None:
        tokens = CASCADE_MIN_TOKENS
    return requests, tokens


@dataclass(slots=True)
class SharedPrefix:
    """The blocks every request of a step (or every member) starts with, and the rest of each
    request.

    Attributes:
        blocks: int32 [n] the shared blocks' ids.
        tokens: Their tokens (n * block_size): every query row of the members comes after them.
        suffix_tables: The block tables from the first block after them (a view; a member's
            rows only mean something).
        suffix_seq_lens: int32 [num_reqs] each request's context after them (members' only).
        members: None (every request shares the blocks), or int32 [m] the requests that do.
        others: None, or bool [num_reqs] the requests that are not members.
    """

    blocks: torch.Tensor
    tokens: int
    suffix_tables: torch.Tensor
    suffix_seq_lens: torch.Tensor
    members: torch.Tensor | None = None
    others: torch.Tensor | None = None


def _common_blocks(tables: torch.Tensor) -> int:
    """How many first columns the rows of ``tables`` all agree on."""
    same = (tables == tables[:1]).all(0)
    return tables.shape[1] if bool(same.all()) else int(same.int().argmin())


def find_shared_prefixes(metadata: AttentionMetadata, min_requests: int, min_tokens: int,
                         subsets: bool = False) -> list[SharedPrefix]:
    """The blocks that every request of the step starts with, where at least ``min_requests``
    requests share at least ``min_tokens`` tokens that come before all of their query rows
    (one SharedPrefix); with ``subsets``, where not every request does, those of each group of
    requests whose tables start with the same block, for the groups that pass the same
    thresholds, largest first (at a tie, the one met first): the members of each (say a
    request computing a prompt that the others of its step found in the prefix cache, or
    traffic under several system prompts). Else none."""
    num_reqs, block_size = metadata.num_reqs, metadata.block_size
    if num_reqs < min_requests:
        return []
    need = max(1, -(-min_tokens // block_size))  # NOTE: a threshold of 0 tokens still needs a block
    # NOTE: only whole blocks before a request's first query row: all of its rows see all of them.
    limits = [(seq - query) // block_size for seq, query in zip(metadata.seq_lens, metadata.query_lens)]
    limit = min(limits)
    if limit >= need:
        blocks = _common_blocks(metadata.block_tables[:num_reqs, :limit])
        if blocks >= need:
            return [_shared(metadata, blocks, None)]
    if not subsets:
        return []
    candidates = [i for i, blocks in enumerate(limits) if blocks >= need]
    if len(candidates) < min_requests:
        return []
    groups: dict[int, list[int]] = {}
    for i, block in zip(candidates, metadata.block_tables[candidates, 0].tolist()):
        groups.setdefault(block, []).append(i)
    found = []
    for members in sorted(groups.values(), key=len, reverse=True):  # NOTE: stable: ties in order met
        if len(members) < min_requests:
            break
        blocks = _common_blocks(metadata.block_tables[members, : min(limits[i] for i in members)])
        if blocks >= need:
            found.append(_shared(metadata, blocks, members))
    return found


def find_shared_prefix(metadata: AttentionMetadata, min_requests: int, min_tokens: int,
                       subsets: bool = False) -> SharedPrefix | None:
    """The first of find_shared_prefixes (the largest group's), or None."""
    found = find_shared_prefixes(metadata, min_requests, min_tokens, subsets)
    return found[0] if found else None


def _shared(metadata: AttentionMetadata, blocks: int, members: list[int] | None) -> SharedPrefix:
    tables = metadata.block_tables[: metadata.num_reqs]
    tokens = blocks * metadata.block_size
    shared = SharedPrefix(blocks=tables[members[0] if members else 0, :blocks].contiguous(), tokens=tokens,
                          suffix_tables=tables[:, blocks:], suffix_seq_lens=metadata.seq_lens_tensor - tokens)
    if members is not None:
        shared.members = torch.tensor(members, dtype=torch.int32)
        shared.others = torch.ones(metadata.num_reqs, dtype=torch.bool)
        shared.others[shared.members.long()] = False
    return shared


# Prefill chunks of at least this many tokens go to the tiles (csrc/tile_attention.c) in
# bfloat16 (float32 too on AVX2's), by kind of tiles (measured: attention-backends.md, "Prefill
# chunks on tiles"; the vector tiles repack a chunk's whole context, which short chunks over
# long contexts do not repay: 64 x 16 tokens over 300 took 0.86x the kernel's time on an AMD
# Zen 4, 64 x 64 over 512 1.08x; the float32 tiles 1.2-1.5x from 16 tokens on an AMD Zen 3).
# PAGODA_PREFILL_TILES_MIN_TOKENS replaces every kind's where the worker starts (0: never).
PREFILL_ON_TILES_MIN_TOKENS_BY_KIND = {"amx": 16, "avx512_bf16": 64, "avx2": 16}
PREFILL_ON_TILES_MIN_TOKENS = read_int("PAGODA_PREFILL_TILES_MIN_TOKENS")
if PREFILL_ON_TILES_MIN_TOKENS == 0:
    PREFILL_ON_TILES_MIN_TOKENS = 10**9


@dataclass(slots=True)
class StepPlan:
    """What cpu_paged derives from a step's metadata once for all layers.

    Attributes:
        shared: The prefix every request (or the largest group) shares, where the cascade pays.
        more_shared: The prefixes of further groups (members apart from the first's).
        tile_requests: int32 [n] the requests whose rows the prefill tiles compute (None: none;
            beside a cascade of groups, of the other requests only).
        skip: bool [num_reqs] the same requests (and the groups' members), for the paged kernel
            to leave alone.
    """

    shared: SharedPrefix | None
    more_shared: list[SharedPrefix] = field(default_factory=list)
    tile_requests: torch.Tensor | None = None
    skip: torch.Tensor | None = None

    @property
    def groups(self) -> list[SharedPrefix]:
        """Every prefix the step's cascade attends to (none: no cascade)."""
        return ([self.shared] if self.shared is not None else []) + self.more_shared


def plan_prefill_on_tiles(metadata: AttentionMetadata, min_tokens: int,
                          groups: list[SharedPrefix] = ()) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """The requests whose chunks have at least ``min_tokens`` query tokens (and a mask of them),
    or None; beside a cascade of groups of requests (``groups``, with members), the other
    requests' chunks (None if none) and a mask of them and the members (the rows the paged
    kernel leaves)."""
    others = None
    for group in groups:
        others = group.others if others is None else others & group.others
    apart = [True] * metadata.num_reqs if others is None else others.tolist()
    chosen = [i for i, tokens in enumerate(metadata.query_lens) if tokens >= min_tokens and apart[i]]
    if not chosen and others is None:
        return None
    skip = torch.zeros(metadata.num_reqs, dtype=torch.bool) if others is None else ~others
    skip[chosen] = True
    return (torch.tensor(chosen, dtype=torch.int32) if chosen else None), skip


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint sets of keys combined into attention over both: each part
    weighted by its share of the softmax's sum (from the log-sum-exps [rows, heads])."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return (out_a.float() * weight_a + out_b.float() * weight_b).to(out_a.dtype)


class CpuPagedAttentionBackend(TorchSdpaAttentionBackend):
    """The paged CPU kernels, with torch_sdpa's code for the dtypes they lack."""

    name = "cpu_paged"
    fp8_kv_cache = FP8_DTYPES
    keys_transposed = True
    supports_window_and_softcap = True
    # NOTE: set by the model runner for batch_invariant: each query row is then computed by
    # the vector kernel alone, never on the prefill tiles or in a cascade (whether a row takes
    # those depends on how its prompt is chunked and on what its step holds).
    batch_invariant = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        # Prefill chunks and the shared part of cascade attention on tiles where they run
        # (bfloat16): AMX's, else AVX512-BF16 dot products on 16 rows, else AVX2's float32
        # ones (for float32 too); else the kernel and torch's flash attention.
        # NOTE: the tiles take head_dim 64 and 128 only; with others a step plans for the kernel.
        self.tiles = cpu_kernels.attention_tiles() if head_dim in (64, 128) else None
        self.amx_tiles = kernel_library.available() and linear_kernels.packed_linear_amx_available()
        self.torch_cascade_pays = kernel_library.available() and cascade_by_torch_pays(self.amx_tiles)

    def tiles_for(self, dtype: torch.dtype) -> str | None:
        """The tiles that take prefill chunks and a cascade's shared part in ``dtype``, or None:
        bfloat16 on any kind, float32 on AVX2's float32 tiles alone."""
        if dtype == torch.bfloat16 or (dtype == torch.float32 and self.tiles == "avx2"):
            return self.tiles
        return None

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        return device.type == "cpu" and kernel_library.available()

    @classmethod
    def shape_problem(cls, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int,
                      window_or_softcap: bool = False) -> str | None:
        if window_or_softcap and not cpu_kernels.supports(dtype):
            return f"its kernels run sliding windows and soft caps in bfloat16 and float32, not {dtype}"
        return None

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str:
        if device.type != "cpu":
            return "it is a CPU backend"
        return "its CPU kernels could not be built (a C compiler is needed; see the log)"

    def prepare(self, metadata: AttentionMetadata) -> None:
        # NOTE: the kernels need nothing beyond the metadata, a shared prefix if any and the
        # requests for the prefill tiles; torch_sdpa's view of the step is built only if a
        # dtype without kernels asks for it (see forward).
        # NOTE: with the thresholds of the tiles where they run: forward() holds a step that
        # the torch path takes (float32 beside other tiles than AVX2's) to its own.
        if self.batch_invariant:
            metadata.backend_data = StepPlan(None)
            return
        # NOTE: a cascade of some of the step's requests with tiles only (their rows on the
        # tiles, the others' as without a cascade).
        groups = find_shared_prefixes(metadata, *cascade_thresholds(self.tiles, self.torch_cascade_pays),
                                      subsets=self.tiles is not None)
        plan = StepPlan(groups[0] if groups else None, groups[1:])
        if self.tiles is not None and (plan.shared is None or plan.shared.members is not None):
            min_tokens = PREFILL_ON_TILES_MIN_TOKENS or PREFILL_ON_TILES_MIN_TOKENS_BY_KIND[self.tiles]
            chosen = plan_prefill_on_tiles(metadata, min_tokens, groups)
            if chosen is not None:
                plan.tile_requests, plan.skip = chosen
        metadata.backend_data = plan

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache
        if not (cpu_kernels.supports(key_cache.dtype) or key_cache.dtype in FP8_DTYPES):
            return super().write_kv(key, value, kv_cache, slot_mapping)
        cpu_kernels.write_kv(to_cache_dtype(key, key_cache.dtype), to_cache_dtype(value, value_cache.dtype), slot_mapping,
                             key_cache, value_cache)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        if window is not None and metadata.max_seq_len <= window:
            window = None  # NOTE: no row is past it: the step's plan (tiles, cascade) holds
        if not cpu_kernels.supports_cache(query.dtype, key_cache.dtype):
            if window is not None or softcap is not None:  # NOTE: shape_problem refuses such models at start
                raise NotImplementedError(f"cpu_paged runs windows and soft caps in bfloat16 and float32, "
                                          f"not {query.dtype}")
            if not isinstance(metadata.backend_data, SdpaStepData):
                super().prepare(metadata)
            return super().forward(query, key, value, kv_cache, metadata)
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        query = query.contiguous()
        if window is not None or softcap is not None:
            return cpu_kernels.paged_attention(query, key_cache, value_cache, metadata.block_tables,
                                               metadata.seq_lens_tensor, metadata.query_start_loc, self.scale,
                                               window=window, softcap=softcap)
        plan: StepPlan = metadata.backend_data
        # NOTE: an fp8 cache is read by the vector kernel alone (the tiles and torch's flash
        # attention take the model's dtype).
        quantized = key_cache.dtype in FP8_DTYPES
        shared = None if quantized else plan.shared
        on_tiles = not quantized and self.tiles_for(query.dtype) is not None
        if shared is not None and shared.members is not None:
            if on_tiles:
                return self._cascade_of_members(query, key_cache, value_cache, metadata, plan)
            shared = None
        if shared is not None and not on_tiles:
            requests, tokens = cascade_thresholds(None, self.torch_cascade_pays)
            if metadata.num_reqs < requests or shared.tokens < tokens:
                shared = None
        if shared is None:
            tiles = on_tiles and plan.tile_requests is not None
            out = cpu_kernels.paged_attention(query, key_cache, value_cache, metadata.block_tables,
                                              metadata.seq_lens_tensor, metadata.query_start_loc, self.scale,
                                              skip=plan.skip if tiles else None)
            if tiles and not cpu_kernels.prefill_attention(query, key_cache, value_cache, metadata.block_tables,
                                                           metadata.seq_lens_tensor, metadata.query_start_loc,
                                                           plan.tile_requests, self.scale, out, self.tiles):
                # NOTE: the tiles could not run (no memory for their operands): every row by the kernel.
                out = cpu_kernels.paged_attention(query, key_cache, value_cache, metadata.block_tables,
                                                  metadata.seq_lens_tensor, metadata.query_start_loc, self.scale)
            return out
        own, own_lse = cpu_kernels.paged_attention(query, key_cache, value_cache, shared.suffix_tables,
                                                   shared.suffix_seq_lens, metadata.query_start_loc, self.scale,
                                                   return_lse=True)
        if on_tiles:
            out = cpu_kernels.shared_prefix_attention(query, key_cache, value_cache, shared.blocks, own, own_lse,
                                                      self.scale, self.tiles)
            if out is not None:
                return out
        common, common_lse = self._attend_shared(query, key_cache, value_cache, shared)
        return merge_attention(common, common_lse, own, own_lse)

    def _cascade_of_members(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            metadata: AttentionMetadata, plan: StepPlan) -> torch.Tensor:
        """A cascade of each group's members on the tiles, the other requests' rows as without
        one (their chunks on the tiles where the plan says, else the kernel)."""
        starts = metadata.query_start_loc
        out = cpu_kernels.paged_attention(query, key_cache, value_cache, metadata.block_tables,
                                          metadata.seq_lens_tensor, starts, self.scale, skip=plan.skip)
        ran = (plan.tile_requests is None
               or cpu_kernels.prefill_attention(query, key_cache, value_cache, metadata.block_tables,
                                                metadata.seq_lens_tensor, starts, plan.tile_requests, self.scale,
                                                out, self.tiles))
        for shared in plan.groups if ran else ():
            own, own_lse = cpu_kernels.paged_attention(query, key_cache, value_cache, shared.suffix_tables,
                                                       shared.suffix_seq_lens, starts, self.scale, return_lse=True,
                                                       skip=shared.others)
            ran = cpu_kernels.shared_prefix_attention(query, key_cache, value_cache, shared.blocks, own, own_lse,
                                                      self.scale, self.tiles, shared.members, starts, out) is not None
            if not ran:
                break
        if not ran:  # NOTE: the tiles could not run (no memory for their operands): every row by the kernel.
            out = cpu_kernels.paged_attention(query, key_cache, value_cache, metadata.block_tables,
                                              metadata.seq_lens_tensor, starts, self.scale)
        return out

    def _attend_shared(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       shared: SharedPrefix) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query row against the shared keys: per KV head, the rows of all its query
        heads as one matrix (no causal mask: every row comes after them).

        Returns:
            [num_tokens, num_heads, head_dim] and the float32 log-sum-exp [num_tokens, num_heads].
        """
        num_tokens, num_heads, head_dim = query.shape
        kv_heads, group = self.num_kv_heads, num_heads // self.num_kv_heads
        # [blocks, kv, head_dim, block_size] (keys transposed) -> [1, kv, tokens, head_dim]
        # NOTE: contiguous: over a single block the reshapes are views whose last dimension is not
        # the innermost one, and torch's CPU flash attention then gives wrong results.
        blocks = shared.blocks.long()
        keys = key_cache[blocks].permute(1, 0, 3, 2).reshape(1, kv_heads, shared.tokens, head_dim).contiguous()
        values = value_cache[blocks].transpose(0, 1).reshape(1, kv_heads, shared.tokens, head_dim).contiguous()
        rows = (query.view(num_tokens, kv_heads, group, head_dim).transpose(0, 1).reshape(1, kv_heads, -1, head_dim)
                .contiguous())
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(rows, keys, values, 0.0, False,
                                                                             scale=self.scale)
        out = out.view(kv_heads, num_tokens, group, head_dim).transpose(0, 1).reshape(num_tokens, num_heads, head_dim)
        lse = lse.view(kv_heads, num_tokens, group).transpose(0, 1).reshape(num_tokens, num_heads)
        return out, lse
