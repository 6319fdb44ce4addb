"""The engine's half of the prefix cache's offload tier (engine/kv_offload.py): which blocks
the tier holds (on disk, or in the worker's host memory), what to store and delete next, and
whether reading a prefix back beats computing it.

The index is a dict of digests over an eviction policy's evictor (``--eviction-policy``,
the same plugin hook as the KV pool's): past the budget the evictor names the block to
delete. With a directory, the start-up scans it: files of the right size are taken in
(oldest first, so the evictor sees them in their age order), temporary files of writers
that died are deleted, and the directory is cut to the budget. Without one (a host-memory
tier alone), the index is the worker's memory's exact list: it starts empty, and the
worker drops a block when the index deletes it.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pagoda.engine.kv_events import DISK_MEDIUM, HOST_MEDIUM
from pagoda.engine.kv_offload import SUFFIX, KVOffloadTarget
from pagoda.plugins.eviction import Evictor, LRUEvictor

# A writer's temporary file older than this is from a process that died mid-write.
_STALE_TMP_SECONDS = 300.0
# Deleted digests remembered (the worker deletes a file within a step or two).
_RECENTLY_DELETED = 4096
# Weight of the newest sample in the read and prefill rates.
_RATE_WEIGHT = 0.3


@dataclass(slots=True)
class KVOffloadStats:
    """Counters of the disk tier (``/metrics``' pagoda:kv_offload_*)."""

    num_stored: int = 0  # blocks sent to be written
    num_loaded: int = 0  # blocks read back into the pool
    num_load_failures: int = 0  # blocks found missing or damaged when read (then computed)
    num_deleted: int = 0  # files deleted to stay within the budget
    num_skipped_loads: int = 0  # prefixes on disk computed instead (reading was slower)
    bytes_read: int = 0
    read_seconds: float = 0.0


class KVTierIndex:
    """The blocks one engine knows in its offload tier, and the work its next step carries.

    Args:
        target: The directory and namespace of this model's blocks; None for a tier in the
            worker's host memory alone.
        file_bytes: One block's size in the tier (a file's, header included).
        max_bytes: The budget of the tier (on disk: this engine's files).
        block_size: Tokens per block (for the rates' comparison).
        evictor: Orders the files for deletion (lru when None).
    """

    def __init__(self, target: KVOffloadTarget | None, file_bytes: int, max_bytes: int, block_size: int,
                 evictor: Evictor | None = None) -> None:
        self.target = target
        self.file_bytes = file_bytes
        self.max_files = max(1, max_bytes // file_bytes)
        self.block_size = block_size
        self.evictor: Evictor = evictor if evictor is not None else LRUEvictor()
        self._ids = itertools.count()
        self._id_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self.stores: list[tuple[int, bytes]] = []  # (block id, digest) for the next step
        self.deletes: list[bytes] = []
        # Files this engine deleted lately: until the worker has, has() must not find them again.
        self._recently_deleted: OrderedDict[bytes, None] = OrderedDict()
        self.stats = KVOffloadStats()
        # KV events (engine/kv_events.py's KVEventLog) where the engine publishes them: the tier's
        # stores and deletions, under the pool's block hashes (known for the blocks this engine
        # stored; files found at start-up are not announced).
        self.events = None
        self.medium = DISK_MEDIUM if target is not None else HOST_MEDIUM
        self._hash_of: dict[bytes, int] = {}
        # Bytes a second read back, and prompt tokens a second computed (None: not measured yet).
        self.read_rate: float | None = None
        self.prefill_rate: float | None = None

    @property
    def num_files(self) -> int:
        return len(self._id_of)

    # -- start-up --------------------------------------------------------------------

    def scan(self) -> int:
        """Takes in the blocks already on disk (a restart's, or another replica's); returns
        how many. Files of another size are deleted (a layout this namespace never wrote)."""
        if self.target is None:
            return 0
        root = self.target.root
        found: list[tuple[float, bytes]] = []
        now = time.time()
        if root.is_dir():
            for sub in os.scandir(root):
                if not sub.is_dir():
                    continue
                for entry in os.scandir(sub.path):
                    name = entry.name
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:
                        continue  # NOTE: another replica deleted it meanwhile
                    if name.endswith(".tmp"):
                        if now - stat.st_mtime > _STALE_TMP_SECONDS:
                            Path(entry.path).unlink(missing_ok=True)
                        continue
                    if not name.endswith(SUFFIX):
                        continue
                    try:
                        digest = bytes.fromhex(name[:-len(SUFFIX)])
                    except ValueError:
                        continue
                    if stat.st_size != self.file_bytes:
                        Path(entry.path).unlink(missing_ok=True)
                        continue
                    found.append((stat.st_mtime, digest))
        found.sort()
        for _, digest in found:
            self._add(digest, 0)
        while self.num_files > self.max_files:
            self.target.path_of(self._pop()).unlink(missing_ok=True)
        return self.num_files

    # -- the scheduler's questions ---------------------------------------------------

    def has(self, digest: bytes) -> bool:
        """Whether the tier holds a block (on disk, or being written): the index, else the
        directory (a file another replica sharing it wrote)."""
        if digest in self._id_of:
            return True
        if (self.target is not None and digest not in self._recently_deleted
                and os.path.exists(self.target.path_of(digest))):
            self._add(digest, 0)
            self._trim()
            return True
        return False

    def worth_loading(self) -> bool:
        """Whether reading a block back is faster than computing its tokens (yes until both
        rates are measured)."""
        if self.read_rate is None or self.prefill_rate is None:
            return True
        return self.file_bytes / self.read_rate < self.block_size / self.prefill_rate

    # -- what happened ---------------------------------------------------------------

    def block_cached(self, block_id: int, digest: bytes, retention: int, block_hash: int | None = None,
                     block_key: tuple | None = None) -> None:
        """A block entered the prefix cache: stored unless the tier holds it (its pool hash and
        key name it in KV events)."""
        if digest in self._id_of:
            return
        self._add(digest, retention)
        self.stores.append((block_id, digest))
        self.stats.num_stored += 1
        if self.events is not None and block_hash is not None:
            self._hash_of[digest] = block_hash
            self.events.stored(block_hash, block_key, self.medium)
        self._trim()

    def used(self, digest: bytes) -> None:
        """A block was read back: it is the most recently used file."""
        file_id = self._id_of.get(digest)
        if file_id is not None:
            self.evictor.remove(file_id)
            self.evictor.add(file_id, 0)

    def forget(self, digests) -> None:
        """Blocks that are not (or not usable) on disk after all."""
        for digest in digests:
            file_id = self._id_of.get(digest)
            if file_id is not None:
                self.evictor.remove(file_id)
                self._remove(digest)

    def drop_pending_stores(self) -> None:
        """Forgets the stores not sent yet: their blocks' contents are not to be trusted (the
        step that filled them failed, or the worker died)."""
        self.forget([digest for _, digest in self.stores])
        self.stats.num_stored -= len(self.stores)
        self.stores = []

    def record_read(self, num_bytes: int, seconds: float) -> None:
        self.stats.bytes_read += num_bytes
        self.stats.read_seconds += seconds
        if num_bytes >= self.file_bytes and seconds > 0:
            self.read_rate = _ema(self.read_rate, num_bytes / seconds)

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        if seconds > 0:
            self.prefill_rate = _ema(self.prefill_rate, num_tokens / seconds)

    def take(self) -> tuple[list[tuple[int, bytes]], list[bytes]]:
        """The stores and deletes for the next step."""
        stores, deletes = self.stores, self.deletes
        self.stores, self.deletes = [], []
        return stores, deletes

    @property
    def has_work(self) -> bool:
        return bool(self.stores or self.deletes)

    # -- internals -------------------------------------------------------------------

    def _add(self, digest: bytes, retention: int) -> None:
        self._recently_deleted.pop(digest, None)
        file_id = next(self._ids)
        self._id_of[digest] = file_id
        self._digest_of[file_id] = digest
        self.evictor.add(file_id, retention)

    def _pop(self) -> bytes:
        """The evictor's choice, out of the index."""
        digest = self._digest_of[self.evictor.pop()]
        self._remove(digest)
        return digest

    def _remove(self, digest: bytes) -> None:
        """Out of the index (the evictor has let go of it already), announced as removed."""
        del self._digest_of[self._id_of.pop(digest)]
        block_hash = self._hash_of.pop(digest, None)
        if block_hash is not None and self.events is not None:
            self.events.removed(block_hash, self.medium)

    def _trim(self) -> None:
        while self.num_files > self.max_files:
            digest = self._pop()
            self.deletes.append(digest)
            self.stats.num_deleted += 1
            self._recently_deleted[digest] = None
            if len(self._recently_deleted) > _RECENTLY_DELETED:
                self._recently_deleted.popitem(last=False)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _RATE_WEIGHT) * old + _RATE_WEIGHT * new
