"""The worker's half of the disk tier (engine/kv_offload.py): snapshots blocks, writes them
between steps, reads them back into the KV cache.

A block to store is copied out of the cache at the start of the step after the one that
filled it, before that step's swaps, copies and loads can overwrite it; the copy waits in
memory, readable by loads, until it is in its file (a temporary name, then a rename: a
reader never sees half a file). The files are written by the worker's own thread once a
step's answer is sent, while the engine applies it and builds the next step, and until
that step arrives (one file at least per step, so that a busy engine does not starve
them): never beside the step's OpenMP threads, which a third thread on their cores would
stall (measured on 2 cores: a writer thread made the steps of `pagoda bench kv-offload` about
30% slower; docs/kv-cache.md).
Loads run in the step that asks for them, before its forward; a block that cannot be read
whole and checked stops its request's run of blocks there, is reported, and its file is
deleted when it is damaged.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from pagoda.attention_backends.base import cache_storage
from pagoda.engine.kv_offload import HEADER, KVOffloadTarget

logger = logging.getLogger(__name__)

# Snapshots waiting to be written, at most (bytes): past it new blocks are not stored (the
# disk, or the time between steps, is too short for the blocks the model fills) and the
# engine is told so.
MAX_PENDING_BYTES = 512 * 1024**2


class KVOffloadIO:
    """Reads and writes one worker's blocks under ``target``, and keeps them in host memory.

    Args:
        target: The directory and namespace of this model's blocks; None: host memory alone.
        kv_caches: The KV cache, one (keys, values) pair per layer, blocks first.
        host_bytes: Host memory for blocks (0: none). In front of a disk tier it keeps the
            blocks used last (least recently used dropped first) and is read before the
            files; alone, it holds exactly the blocks the engine's index lists (the index's
            deletes drop them).
    """

    def __init__(self, target: KVOffloadTarget | None, kv_caches, host_bytes: int = 0) -> None:
        self.target = target
        self.tensors = [cache_storage(t) for pair in kv_caches for t in pair]
        self.device = self.tensors[0].device
        self.widths = [t[0].numel() * t.element_size() for t in self.tensors]
        self.payload_bytes = sum(self.widths)
        self.file_bytes = HEADER.size + self.payload_bytes
        self._pending: dict[bytes, torch.Tensor] = {}  # digest -> its snapshot (a row of file_bytes)
        # What to do on disk, in order: ("store", digest, row) and ("delete", digest, None).
        self._queue: deque[tuple[str, bytes, torch.Tensor | None]] = deque()
        self._made_dirs: set[str] = set()
        self._warned: set[str] = set()
        self.host: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # digest -> row, least recently used first
        self.host_capacity = host_bytes // self.file_bytes

    # -- storing ---------------------------------------------------------------------

    def store(self, stores: list[tuple[int, bytes]]) -> list[bytes]:
        """Snapshots blocks (block id, digest) and queues their files; returns the digests
        not stored (the writer is too far behind)."""
        if self.target is None:  # NOTE: host memory alone: the engine's budget is its size
            rows = self._gather([block_id for block_id, _ in stores])
            self.host.update((digest, row) for row, (_, digest) in zip(rows, stores))
            return []
        room = max(0, MAX_PENDING_BYTES // self.file_bytes - len(self._pending))
        dropped = [digest for _, digest in stores[room:]]
        stores = stores[:room]
        if stores:
            rows = self._gather([block_id for block_id, _ in stores])
            for row, (_, digest) in zip(rows, stores):
                self._pending[digest] = row
                self._queue.append(("store", digest, row))
                self._keep(digest, row)
        return dropped

    def delete(self, digests: list[bytes]) -> None:
        """Drops blocks: from host memory at once, their files after the stores queued before."""
        for digest in digests:
            self.host.pop(digest, None)
        if self.target is not None:
            self._queue.extend(("delete", digest, None) for digest in digests)

    def _keep(self, digest: bytes, row: torch.Tensor) -> None:
        """In front of the disk: the block joins host memory as the most recently used."""
        if self.host_capacity:
            self.host[digest] = row
            self.host.move_to_end(digest)
            while len(self.host) > self.host_capacity:
                self.host.popitem(last=False)

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """``[n, file_bytes]`` uint8 on the CPU: each block's payload after room for its header."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        rows = torch.empty(len(block_ids), self.file_bytes, dtype=torch.uint8)
        offset = HEADER.size
        for tensor, width in zip(self.tensors, self.widths):
            part = tensor.index_select(0, ids).reshape(len(block_ids), -1).view(torch.uint8)
            rows[:, offset:offset + width].copy_(part)
            offset += width
        return rows

    def write(self, more: Callable[[], bool]) -> None:
        """Works through the queue: one operation, then more while ``more()`` says so."""
        queue = self._queue
        while queue:
            op, digest, row = queue.popleft()
            if op == "delete":
                self.target.path_of(digest).unlink(missing_ok=True)
            else:
                try:
                    self._write(digest, row)
                except OSError as exc:
                    self._warn_once("write", "could not write a KV block to %s: %s (blocks are not stored until "
                                    "it works again)", self.target.root, exc)
                if self._pending.get(digest) is row:
                    del self._pending[digest]
            if not more():
                return

    def _write(self, digest: bytes, row: torch.Tensor) -> None:
        path = self.target.path_of(digest)
        parent = str(path.parent)
        if parent not in self._made_dirs:
            os.makedirs(parent, exist_ok=True)
            self._made_dirs.add(parent)
        data = row.numpy()
        payload = data[HEADER.size:]
        data[:HEADER.size] = memoryview(self.target.header(digest, self.payload_bytes, zlib.crc32(payload)))
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def flush(self, timeout: float = 10.0) -> bool:
        """Writes what is queued, for at most ``timeout`` seconds; False when some is left."""
        deadline = time.monotonic() + timeout
        self.write(lambda: time.monotonic() < deadline)
        return not self._queue

    # -- loading ---------------------------------------------------------------------

    def load(self, loads: dict[str, list[tuple[int, bytes]]]) -> tuple[dict[str, int], list[bytes], int, float]:
        """Reads blocks into the cache: per request, its (block id, digest) run in order.

        Returns:
            Per request, how many of its blocks were loaded (a run stops at the first block
            missing or damaged); the digests of those blocks; the bytes read back (from host
            memory or disk); the seconds.
        """
        start = time.perf_counter()
        loaded: dict[str, int] = {}
        failed: list[bytes] = []
        block_ids: list[int] = []
        rows: list[torch.Tensor] = []
        for request_id, pairs in loads.items():
            count = 0
            for block_id, digest in pairs:
                row = self._read(digest)
                if row is None:
                    failed.append(digest)
                    break
                block_ids.append(block_id)
                rows.append(row)
                count += 1
            loaded[request_id] = count
        if rows:
            self._scatter(block_ids, torch.stack(rows))
        return loaded, failed, len(rows) * self.file_bytes, time.perf_counter() - start

    def _read(self, digest: bytes) -> torch.Tensor | None:
        """A block (header included) as a uint8 row: from host memory, a snapshot still waiting
        for the writer, or its file, checked; None when it cannot be used."""
        row = self.host.get(digest)
        if row is not None:
            self.host.move_to_end(digest)
            return row
        row = self._pending.get(digest)
        if row is not None or self.target is None:
            return row
        path = self.target.path_of(digest)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                row = torch.empty(size, dtype=torch.uint8)
                # NOTE: a file cut short while being read has fewer bytes: the header's check refuses it.
                row = row[:f.readinto(row.numpy())]
                data = row.numpy()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._warn_once("read", "could not read KV block %s: %s", path, exc)
            return None
        try:
            crc = self.target.check_header(data, digest, self.payload_bytes)
            if zlib.crc32(data[HEADER.size:]) != crc:
                raise ValueError("its checksum does not match")
        except ValueError as exc:
            logger.warning("KV block %s is not used: %s; deleted", path.name, exc)
            path.unlink(missing_ok=True)
            return None
        self._keep(digest, row)
        return row

    def _scatter(self, block_ids: list[int], rows: torch.Tensor) -> None:
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        offset = HEADER.size
        for tensor, width in zip(self.tensors, self.widths):
            part = rows[:, offset:offset + width].contiguous().view(tensor.dtype).view(len(block_ids), *tensor.shape[1:])
            tensor.index_copy_(0, ids, part.to(self.device))
            offset += width

    def _warn_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)
