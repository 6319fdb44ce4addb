"""KVCacheManager: per-request block tables on top of the block pool.

Prefix caching, copy-on-write for forked requests and swapping to a CPU swap space are
all block-table operations, so they live here; the scheduler only asks for slots.

Sliding windows: where every layer of the model attends within a window (Mistral, Phi-3,
Mixtral served past their window), the blocks that every later query's window has passed go
back to the pool as the request grows (they stay in the prefix cache until evicted), so a
request holds about window / block_size blocks however long it gets. Their places in the
block table hold OUT_OF_WINDOW; the worker keeps the old ids there, which its attention never
reads (it starts each row at its window).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.engine.core.block_pool import BlockKey, BlockPool, KVBlock
from pagoda.engine.kv_offload import block_digest
from pagoda.plugins.eviction import Evictor

if TYPE_CHECKING:
    from pagoda.engine.core.kv_offload_index import KVTierIndex
    from pagoda.engine.core.request import Request


@dataclass(slots=True)
class KVCacheUsage:
    """A snapshot of the KV cache for metrics and tests.

    Attributes:
        num_blocks: Blocks in the pool.
        num_used_blocks: Blocks held by at least one request.
        num_free_blocks: Blocks on the free queue (cached or not).
        num_cached_free_blocks: Free blocks that still hold a reusable cached prefix.
        num_shared_blocks: Blocks held by more than one request.
        num_tokens: Token slots that hold (or are being filled with) a request's K/V.
        num_unused_slots: Slots allocated to requests but not holding a token yet.
        num_cpu_blocks: Blocks of the CPU swap space.
        num_free_cpu_blocks: Free blocks of the swap space.
        num_swapped_requests: Requests whose KV is in the swap space.
        num_sliding_blocks: Of num_blocks, those of the sliding layers' own pool (a model
            whose layers only partly slide; 0 otherwise).
        num_used_sliding_blocks: Of num_used_blocks, those of that pool.
    """

    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    num_shared_blocks: int
    num_tokens: int
    num_unused_slots: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_swapped_requests: int
    num_sliding_blocks: int = 0
    num_used_sliding_blocks: int = 0

    @property
    def usage(self) -> float:
        """The fraction of blocks used; with a pool for the sliding layers, of the fuller pool
        (either one running out stops the requests)."""
        if not self.num_sliding_blocks:
            return self.num_used_blocks / self.num_blocks
        return max((self.num_used_blocks - self.num_used_sliding_blocks) / (self.num_blocks - self.num_sliding_blocks),
                   self.num_used_sliding_blocks / self.num_sliding_blocks)


@dataclass(slots=True)
class SlotAllocation:
    """What allocate_slots changed in a request's block table.

    Attributes:
        new_block_ids: Blocks appended to the table.
        copies: (source, destination) block copies to run before the step: the
            copy-on-write of a shared partial block that the step writes into.
        table_changed: A block other than the appended ones was replaced, so the
            worker needs the whole table (both, with the sliding layers' own).
        new_sliding_block_ids: Blocks appended to the sliding layers' own table (a model
            whose layers only partly slide: engine/core/hybrid_kv_cache_manager.py).
    """

    new_block_ids: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    table_changed: bool = False
    new_sliding_block_ids: list[int] = field(default_factory=list)


# What allocate_slots returns when nothing but the token count changed (shared; not to be mutated).
UNCHANGED = SlotAllocation()

# The place of a block given back because every later query's window has passed it (never in
# the pool; the worker is sent block 0 there and never reads it).
OUT_OF_WINDOW = KVBlock(0)


class KVCacheManager:
    """Owns every request's block table; allocates blocks on demand as requests grow.

    A request never reserves its maximum length: each step asks for just the slots the
    step's new tokens need.

    Args:
        num_blocks: Number of physical blocks.
        block_size: Tokens per block.
        enable_prefix_caching: Reuse cached full blocks across requests.
        num_cpu_blocks: Blocks in the CPU swap space (0: no swapping).
        evictor: Eviction order of cached free blocks (an eviction-policy plugin's).
        sliding_window: Every layer attends within this many positions (None: no window):
            the blocks before every later query's window go back to the pool.
        lookback: Positions a request's computed tokens may go back by (rejected draft
            tokens): the blocks of that many more positions before the window are kept.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, evictor: Evictor | None = None, sliding_window: int | None = None,
                 lookback: int = 0) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.lookback = lookback
        # Leading blocks of each request given back as out of every later query's window.
        self.req_to_dropped: dict[str, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, evictor=evictor)
        self.req_retention: dict[str, int] = {}
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.req_to_num_tokens: dict[str, int] = {}
        self.req_to_hashes: dict[str, list[tuple[int, BlockKey]]] = {}
        # Leading blocks of each request already registered in the prefix cache.
        self.req_to_num_cached: dict[str, int] = {}
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.req_to_cpu_blocks: dict[str, list[int]] = {}
        # The disk tier (engine/core/kv_offload_index.py) when on: every block that enters the
        # prefix cache is stored there; and each request's blocks' digests (its names on disk).
        self.offload: KVTierIndex | None = None
        self.req_to_digests: dict[str, list[bytes]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def used_fraction(self) -> float:
        """The fraction of the pool's blocks not free (the load figure of metrics and routing)."""
        return 1 - self.get_num_free_blocks() / self.num_blocks

    def all_blocks(self) -> list[KVBlock]:
        """Every block of the pool, in block id order (the console's map)."""
        return self.block_pool.blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix caching ---------------------------------------------------------------

    def block_hashes(self, request: Request, num_blocks: int) -> list[tuple[int, BlockKey]]:
        """Hashes of the request's first ``num_blocks`` full blocks, computed once each.

        A block's key is (parent hash, its token ids, extra keys); the first block's
        extra keys carry the request's cache salt, which the chain passes on to every
        later block, so requests with different salts never share.
        """
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        while len(hashes) < num_blocks:
            i = len(hashes)
            key = self._block_key(hashes[-1][0] if hashes else None, request.all_token_ids, i, request.cache_salt)
            hashes.append((hash(key), key))
        return hashes

    def _block_key(self, parent: int | None, token_ids: list[int], index: int, cache_salt: str | None) -> BlockKey:
        size = self.block_size
        extra = (cache_salt,) if index == 0 and cache_salt is not None else ()
        return (parent, tuple(token_ids[index * size : (index + 1) * size]), extra)

    def num_cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of a prompt the prefix cache holds now (no side effects;
        for routing between replicas)."""
        if not self.enable_prefix_caching:
            return 0
        parent = None
        for i in range((len(token_ids) - 1) // self.block_size):
            key = self._block_key(parent, token_ids, i, cache_salt)
            parent = hash(key)
            if self.block_pool.get_cached_block(parent, key) is None:
                return i * self.block_size
        return (len(token_ids) - 1) // self.block_size * self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks that starts the request's tokens.

        At least the last token is always left to compute, so that the step that
        admits the request produces its logits.

        Returns:
            The blocks and the number of tokens they hold.
        """
        if not self.enable_prefix_caching or request.request_id in self.req_to_blocks:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash, key in self.block_hashes(request, max_blocks):
            block = self.block_pool.get_cached_block(block_hash, key)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # -- the disk tier -----------------------------------------------------------------

    def block_digests(self, request: Request, num_blocks: int) -> list[bytes]:
        """Names on disk of the request's first ``num_blocks`` full blocks (a digest chain
        over the same tokens and salt as the hash chain, stable across processes)."""
        digests = self.req_to_digests.setdefault(request.request_id, [])
        size, token_ids = self.block_size, request.all_token_ids
        while len(digests) < num_blocks:
            i = len(digests)
            digests.append(block_digest(digests[-1] if digests else None, token_ids[i * size:(i + 1) * size],
                                        request.cache_salt if i == 0 else None))
        return digests

    def offloaded_blocks(self, request: Request, start: int) -> list[bytes]:
        """Digests of the run of the request's blocks on disk from block ``start`` on (the
        blocks after the pool's hits), leaving the last token to compute."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        count = start
        # NOTE: digests as far as the run goes (a long prompt not on disk costs the first miss only).
        while count < max_blocks and self.offload.has(self.block_digests(request, count + 1)[count]):
            count += 1
        return self.req_to_digests[request.request_id][start:count] if count > start else []

    def allocate_for_load(self, request: Request, computed_blocks: list[KVBlock],
                          num_blocks: int) -> list[KVBlock] | None:
        """A request's first allocation when its prefix is read from disk: the pool's hits,
        then ``num_blocks`` blocks to read into, none of them cached until the read is
        confirmed (finish_load). None when the pool has too few free blocks."""
        num_revived = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_blocks > self.get_num_free_blocks() - num_revived:
            return None
        request_id = request.request_id
        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_blocks)
        self.req_to_blocks[request_id] = [*computed_blocks, *new_blocks]
        self.req_retention[request_id] = request.kv_retention
        self.req_to_num_tokens[request_id] = (len(computed_blocks) + num_blocks) * self.block_size
        self.req_to_num_cached[request_id] = len(computed_blocks)
        return new_blocks

    def finish_load(self, request: Request, num_blocks: int) -> None:
        """The read of a request's blocks is over: its first ``num_blocks`` blocks hold its
        prefix (they join the prefix cache), the rest go back to the pool."""
        request_id = request.request_id
        if num_blocks == 0:
            self.free(request_id)
            return
        blocks = self.req_to_blocks[request_id]
        unused = blocks[num_blocks:]
        del blocks[num_blocks:]
        self.block_pool.free_blocks(reversed(unused), self.req_retention.get(request_id, 0))
        self.req_to_num_tokens[request_id] = num_blocks * self.block_size
        self._cache_full_blocks(request, num_blocks * self.block_size)

    # -- allocation -------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> SlotAllocation | None:
        """Grows a request's block table to hold the step's new tokens.

        Args:
            request: The request; ``request.num_computed_tokens`` tokens are in cache.
            num_new_tokens: Tokens the step computes for it.
            computed_blocks: Prefix-cache hits from get_computed_blocks (first
                allocation only); they count as computed tokens.

        Returns:
            What changed, or None when the pool has too few free blocks; nothing is
            allocated then.
        """
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        if blocks and not computed_blocks:
            # NOTE: the common decode case, checked first: the tokens fit in the blocks the
            # request holds and the block written into is its own; nothing changes but
            # the token count (and a block that just filled up joins the prefix cache).
            num_computed = request.num_computed_tokens
            num_total = num_computed + num_new_tokens
            index, offset = divmod(num_computed, self.block_size)
            if num_total <= len(blocks) * self.block_size and (
                    offset == 0 or index >= len(blocks) or blocks[index].ref_cnt == 1):
                if num_total > self.req_to_num_tokens[request_id]:
                    self.req_to_num_tokens[request_id] = num_total
                if self.sliding_window is not None:
                    self._drop_out_of_window(request_id, blocks, num_computed)
                # NOTE: _cache_full_blocks's own first test, here to save a call per request
                # per step in the steps where no block fills up.
                if (self.enable_prefix_caching and min(num_total, len(request.all_token_ids)) // self.block_size
                        > self.req_to_num_cached.get(request_id, 0)):
                    self._cache_full_blocks(request, num_total)
                return UNCHANGED
        computed_blocks = computed_blocks or []
        blocks = blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_new_blocks, needs_cow, cow_index, num_passed, short = self._needs(blocks, computed_blocks, num_computed,
                                                                             num_total)
        if short:
            return None

        result = SlotAllocation()
        if computed_blocks:
            self.block_pool.touch(computed_blocks[num_passed:])
            blocks = [OUT_OF_WINDOW] * num_passed + list(computed_blocks[num_passed:])
            if num_passed:
                self.req_to_dropped[request_id] = num_passed
        self.req_to_blocks[request_id] = blocks
        self.req_retention[request_id] = request.kv_retention
        if needs_cow:
            source = blocks[cow_index]
            (copy,) = self.block_pool.get_new_blocks(1)
            blocks[cow_index] = copy
            self.block_pool.free_blocks([source], request.kv_retention)
            result.copies.append((source.block_id, copy.block_id))
            result.table_changed = True
        if num_new_blocks > 0:
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
            result.new_block_ids = [block.block_id for block in new_blocks]
        self.req_to_num_tokens[request_id] = max(num_total, self.req_to_num_tokens.get(request_id, 0))
        self._cache_full_blocks(request, num_total)
        if self.sliding_window is not None:
            self._drop_out_of_window(request_id, blocks, num_computed)
        return result

    def _needs(self, blocks: list[KVBlock], computed_blocks: list[KVBlock], num_computed: int,
               num_total: int) -> tuple[int, bool, int, int, bool]:
        """What growing a table of ``blocks`` (plus prefix hits) to ``num_total`` tokens takes:
        new blocks, whether (and where) a shared partial block is copied first, the hits before
        the window, and whether the pool is short of free blocks for it."""
        num_new_blocks = self.num_blocks_needed(num_total) - len(blocks) - len(computed_blocks)
        # The first new token lands in a partial block shared with another request:
        # that block is copied before the step writes into it.
        cow_index = num_computed // self.block_size
        needs_cow = (num_computed % self.block_size != 0 and cow_index < len(blocks)
                     and blocks[cow_index].ref_cnt > 1)
        # NOTE: hits before the window are not taken from the pool (their places: OUT_OF_WINDOW).
        num_passed = min(self._num_passed(num_computed), len(computed_blocks))
        num_revived = sum(1 for block in computed_blocks[num_passed:] if block.ref_cnt == 0)
        short = max(num_new_blocks, 0) + needs_cow > self.get_num_free_blocks() - num_revived
        return num_new_blocks, needs_cow, cow_index, num_passed, short

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_blocks: list[KVBlock] | None = None) -> bool:
        """Whether allocate_slots would find the blocks it needs (it changes nothing)."""
        blocks = self.req_to_blocks.get(request.request_id) or []
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        return not self._needs(blocks, computed_blocks, num_computed, num_computed + num_new_tokens)[-1]

    def _num_passed(self, num_computed: int) -> int:
        """Leading blocks of a request with ``num_computed`` tokens in cache that no later query
        sees: wholly before the window of the next token (less the lookback)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.lookback - self.sliding_window + 1) // self.block_size

    def _drop_out_of_window(self, request_id: str, blocks: list[KVBlock], num_computed: int) -> None:
        """Gives back the request's blocks that every later query's window has passed."""
        num_passed = self._num_passed(num_computed)
        dropped = self.req_to_dropped.get(request_id, 0)
        if num_passed <= dropped:
            return
        passed = blocks[dropped:num_passed]
        blocks[dropped:num_passed] = [OUT_OF_WINDOW] * len(passed)
        self.req_to_dropped[request_id] = num_passed
        self.block_pool.free_blocks(reversed(passed), self.req_retention.get(request_id, 0))

    def _held(self, request_id: str) -> list[KVBlock]:
        """The blocks a request holds (its table less the places out of the window)."""
        return self.req_to_blocks.get(request_id, [])[self.req_to_dropped.get(request_id, 0):]

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        # NOTE: only blocks of known tokens: a slot may be allocated for a token that a
        # step in flight is still sampling; its block is cached by a later call.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = max(self.req_to_num_cached.get(request_id, 0), self.req_to_dropped.get(request_id, 0))
        if num_full <= start:
            return
        blocks = self.req_to_blocks[request_id]
        cached = [i for i, (block_hash, key) in enumerate(self.block_hashes(request, num_full)[start:num_full], start)
                  if self.block_pool.cache_block(blocks[i], block_hash, key)]
        if cached and self.offload is not None:
            # NOTE: after the pool's, so that each medium's KV events come as one chain.
            digests, hashes = self.block_digests(request, num_full), self.req_to_hashes[request_id]
            for i in cached:
                self.offload.block_cached(blocks[i].block_id, digests[i], request.kv_retention, *hashes[i])
        self.req_to_num_cached[request_id] = num_full

    def fork(self, parent: Request, child: Request) -> list[int]:
        """Gives ``child`` the parent's whole block table, partial last block included.

        Returns:
            The child's block ids.
        """
        blocks = list(self.req_to_blocks[parent.request_id])
        self.block_pool.touch(self._held(parent.request_id))
        self.req_to_blocks[child.request_id] = blocks
        if parent.request_id in self.req_to_dropped:
            self.req_to_dropped[child.request_id] = self.req_to_dropped[parent.request_id]
        self.req_to_num_tokens[child.request_id] = self.req_to_num_tokens.get(parent.request_id, 0)
        self.req_to_hashes[child.request_id] = list(self.req_to_hashes.get(parent.request_id, []))
        if parent.request_id in self.req_to_digests:
            self.req_to_digests[child.request_id] = list(self.req_to_digests[parent.request_id])
        self.req_to_num_cached[child.request_id] = self.req_to_num_cached.get(parent.request_id, 0)
        self.req_retention[child.request_id] = child.kv_retention
        return [block.block_id for block in blocks]

    def free(self, request_id: str) -> None:
        """Releases every block of a request (and its swap space), tail first."""
        blocks = self._held(request_id)
        self.req_to_blocks.pop(request_id, None)
        self.req_to_dropped.pop(request_id, None)
        self.req_to_num_tokens.pop(request_id, None)
        self.req_to_hashes.pop(request_id, None)
        self.req_to_digests.pop(request_id, None)
        self.req_to_num_cached.pop(request_id, None)
        retention = self.req_retention.pop(request_id, 0)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks), retention)
        self.free_cpu_blocks.extend(cpu for cpu in self.req_to_cpu_blocks.pop(request_id, ()) if cpu >= 0)

    def reset(self) -> None:
        """Forgets every block table, cached block and swapped request (the KV tensors
        they described are gone)."""
        self.block_pool.reset()
        self.req_retention.clear()
        self.req_to_blocks.clear()
        self.req_to_dropped.clear()
        self.req_to_num_tokens.clear()
        self.req_to_hashes.clear()
        self.req_to_digests.clear()
        self.req_to_num_cached.clear()
        self.free_cpu_blocks = list(range(self.num_cpu_blocks - 1, -1, -1))
        self.req_to_cpu_blocks.clear()

    def reset_prefix_cache(self) -> int:
        """Evicts every cached block that no request holds; returns how many."""
        return self.block_pool.evict_cached_free_blocks()

    def uncache(self, request_id: str) -> None:
        """Takes a request's blocks out of the prefix cache (their contents are suspect)."""
        for block in self._held(request_id):
            self.block_pool.uncache_block(block)
        self.req_to_num_cached.pop(request_id, None)

    def get_block_ids(self, request_id: str, held: bool = False) -> list[int]:
        """The request's block table (block 0 where a block was given back as out of the
        window), or with ``held`` only the blocks it holds."""
        blocks = self._held(request_id) if held else self.req_to_blocks.get(request_id, ())
        return [block.block_id for block in blocks]

    def get_sliding_block_ids(self, request_id: str) -> list[int] | None:
        """The sliding layers' own table where they have one (never here: every layer reads
        get_block_ids's)."""
        return None

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks the request holds (0 when it holds none)."""
        return len(self._held(request_id))

    # -- swapping ---------------------------------------------------------------------

    def can_swap_out(self, request_id: str) -> bool:
        return self.num_blocks_held(request_id) <= len(self.free_cpu_blocks)

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Moves a request's blocks to the swap space and frees them (the places out of the
        window stay so: they come back as such).

        Returns:
            (block id, cpu block id) pairs for the worker to copy before the step.
        """
        blocks = self._held(request_id)
        dropped = self.req_to_dropped.pop(request_id, 0)
        del self.req_to_blocks[request_id]
        cpu_blocks = [self.free_cpu_blocks.pop() for _ in blocks]
        self.req_to_cpu_blocks[request_id] = [-1] * dropped + cpu_blocks
        self.req_to_num_cached.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks), self.req_retention.get(request_id, 0))
        return [(block.block_id, cpu) for block, cpu in zip(blocks, cpu_blocks)]

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.req_to_cpu_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.free_cpu_blocks)

    def get_cpu_block_ids(self, request_id: str) -> list[int]:
        """The swap-space blocks holding a swapped-out request (empty when it is not swapped)."""
        return [cpu for cpu in self.req_to_cpu_blocks.get(request_id, ()) if cpu >= 0]

    def num_blocks_to_swap_in(self, request: Request, num_new_tokens: int) -> int:
        """Blocks a swapped request needs to come back and run ``num_new_tokens`` more tokens."""
        places = self.req_to_cpu_blocks[request.request_id]
        num_swapped = sum(1 for cpu in places if cpu >= 0)
        return num_swapped + max(0, self.num_blocks_needed(request.num_computed_tokens + num_new_tokens) - len(places))

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Whether a swapped request can come back and run ``num_new_tokens`` more tokens."""
        return self.num_blocks_to_swap_in(request, num_new_tokens) <= self.get_num_free_blocks()

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Brings a swapped request back into fresh blocks (check can_swap_in first).

        Returns:
            (cpu block id, block id) pairs for the worker to copy before the step.
        """
        places = self.req_to_cpu_blocks.pop(request.request_id)
        dropped = sum(1 for cpu in places if cpu < 0)
        cpu_blocks = places[dropped:]
        blocks = self.block_pool.get_new_blocks(len(cpu_blocks))
        assert blocks is not None, "can_swap_in was not checked"
        self.req_to_blocks[request.request_id] = [OUT_OF_WINDOW] * dropped + blocks
        if dropped:
            self.req_to_dropped[request.request_id] = dropped
        self.free_cpu_blocks.extend(cpu_blocks)
        self._cache_full_blocks(request, request.num_computed_tokens)
        return [(cpu, block.block_id) for cpu, block in zip(cpu_blocks, blocks)]

    # -- introspection ----------------------------------------------------------------

    def usage(self) -> KVCacheUsage:
        num_free = self.get_num_free_blocks()
        # NOTE: the tokens and slots of the blocks held (not of the places out of the window).
        dropped = sum(self.req_to_dropped.values()) * self.block_size
        num_tokens = sum(self.req_to_num_tokens.get(r, 0) for r in self.req_to_blocks) - dropped
        num_slots = sum(len(blocks) for blocks in self.req_to_blocks.values()) * self.block_size - dropped
        return KVCacheUsage(
            num_blocks=self.num_blocks,
            num_used_blocks=self.num_blocks - num_free,
            num_free_blocks=num_free,
            num_cached_free_blocks=len(self.block_pool.evictor),
            num_shared_blocks=self.block_pool.num_shared_blocks(),
            num_tokens=num_tokens,
            num_unused_slots=num_slots - num_tokens,
            num_cpu_blocks=self.num_cpu_blocks,
            num_free_cpu_blocks=len(self.free_cpu_blocks),
            num_swapped_requests=len(self.req_to_cpu_blocks),
        )

    def check_invariants(self) -> None:
        """Asserts DESIGN.md's invariants; for tests and debugging, O(num_blocks)."""
        holders: dict[int, int] = {}
        for request_id, blocks in self.req_to_blocks.items():
            dropped = self.req_to_dropped.get(request_id, 0)
            assert all(block is OUT_OF_WINDOW for block in blocks[:dropped]), "a block out of the window is held"
            assert OUT_OF_WINDOW not in blocks[dropped:], "a place out of the window after held blocks"
            for block in blocks[dropped:]:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        free_ids = set(self.block_pool.free_block_ids())
        assert len(free_ids) == self.get_num_free_blocks(), "free block count is off"
        assert all(b.block_hash is None for b in self.block_pool.free_uncached), "cached block among uncached"
        for block in self.block_pool.blocks:
            num_holders = holders.get(block.block_id, 0)
            assert block.ref_cnt == num_holders, f"{block}: held by {num_holders} block tables"
            assert (block.block_id in free_ids) == (block.ref_cnt == 0), f"{block}: free and owned"
            if block.block_hash is not None:
                assert self.block_pool.cached_blocks.get(block.block_hash) is block, f"{block}: stale hash"
        for block_hash, block in self.block_pool.cached_blocks.items():
            assert block.block_hash == block_hash and hash(block.block_key) == block_hash
        for request_id, blocks in self.req_to_blocks.items():
            assert self.num_blocks_needed(self.req_to_num_tokens.get(request_id, 0)) <= len(blocks)
        owned_cpu = [cpu for cpu_blocks in self.req_to_cpu_blocks.values() for cpu in cpu_blocks if cpu >= 0]
        assert sorted(owned_cpu + self.free_cpu_blocks) == list(range(self.num_cpu_blocks)), "swap space leak"
        assert not set(self.req_to_blocks) & set(self.req_to_cpu_blocks), "request both swapped and resident"
