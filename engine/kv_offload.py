"""The disk tier of the prefix cache: what the engine and the worker agree on.

Every full block of a prompt (or of an output) that enters the prefix cache is also written
to a file, named by a digest of its whole prefix, under a directory named by a digest of
the model and of the KV layout. A request whose prefix is not in the KV pool any more, or
never was since the server started, gets those blocks read back instead of recomputed.

The engine process keeps the index of the files (engine/core/kv_offload_index.py) and
decides what is read; the worker snapshots, writes and reads the blocks
(engine/worker/kv_offload_io.py). A file is::

    header (64 bytes): b"PAGODAKV", format version, header size, namespace digest,
                       block digest, payload size, CRC-32 of the payload
    payload:           the block's bytes, layer by layer, keys then values

A file whose header, size or checksum does not match what the reader expects (another
model, another layout, a truncated or damaged file) is never used: it is deleted and the
tokens are computed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1
MAGIC = b"PAGODAKV"
HEADER = struct.Struct("<8sII16s16sQI4x")  # magic, version, header size, namespace, digest, payload, crc32
DIGEST_BYTES = 16
SUFFIX = ".kv"
DEFAULT_OFFLOAD_BYTES = 8 * 1024**3
# How much of each weight file the model's fingerprint reads: a few samples, not the file.
_SAMPLES_PER_FILE = 8
_SAMPLE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class KVOffloadTarget:
    """Where one model's blocks live: ``directory / namespace`` (hex)."""

    directory: Path
    namespace: bytes

    @property
    def root(self) -> Path:
        return self.directory / self.namespace.hex()

    def path_of(self, digest: bytes) -> Path:
        """A block's file: two hex digits of fan-out, then the digest."""
        name = digest.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def header(self, digest: bytes, payload_bytes: int, crc: int) -> bytes:
        return HEADER.pack(MAGIC, FORMAT_VERSION, HEADER.size, self.namespace, digest, payload_bytes, crc)

    def check_header(self, data: bytes | memoryview, digest: bytes, payload_bytes: int) -> int:
        """The payload's CRC-32 from a file's first bytes.

        Raises:
            ValueError: The file is not this model's and layout's block ``digest``, or not whole.
        """
        if len(data) != HEADER.size + payload_bytes:
            raise ValueError(f"{len(data)} bytes where {HEADER.size + payload_bytes} were expected")
        magic, version, size, namespace, file_digest, payload, crc = HEADER.unpack_from(data)
        if magic != MAGIC or version != FORMAT_VERSION or size != HEADER.size:
            raise ValueError("not a Pagoda KV block of this format")
        if namespace != self.namespace:
            raise ValueError("a block of another model or KV layout")
        if file_digest != digest or payload != payload_bytes:
            raise ValueError("the header names another block")
        return crc


def default_offload_bytes(directory: Path) -> int:
    """The disk tier's budget when none is given: 8 GiB, or half the disk's free space if less."""
    directory.mkdir(parents=True, exist_ok=True)
    return min(DEFAULT_OFFLOAD_BYTES, shutil.disk_usage(directory).free // 2)


def block_digest(parent: bytes | None, token_ids, cache_salt: str | None) -> bytes:
    """A block's name on disk: a digest of its parent's digest, its tokens and (for a first
    block) the request's cache salt, stable across processes (Python's hash() of a string is
    not)."""
    h = hashlib.blake2b(parent or b"\x00", digest_size=DIGEST_BYTES)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if cache_salt is not None:
        h.update(b"\x01salt" + cache_salt.encode())
    return h.digest()


def model_fingerprint(model_path: Path) -> str:
    """A digest of a model's checkpoint that changes when its weights do, read in milliseconds:
    its config, and per weight file the name, size and a few samples of its bytes."""
    h = hashlib.blake2b(digest_size=16)
    files = [model_path] if model_path.is_file() else sorted(
        p for p in model_path.iterdir() if p.suffix in (".json", ".safetensors", ".bin", ".gguf", ".pt")
        and p.name not in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\x00{size}\x00".encode())
        with open(path, "rb") as f:
            if path.suffix == ".json" or size <= _SAMPLES_PER_FILE * _SAMPLE_BYTES:
                h.update(f.read())
                continue
            for i in range(_SAMPLES_PER_FILE):
                f.seek((size - _SAMPLE_BYTES) * i // (_SAMPLES_PER_FILE - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def namespace_of(description: dict) -> bytes:
    """The namespace digest of a model and KV layout ``description`` (JSON-able)."""
    text = json.dumps({"format": FORMAT_VERSION, **description}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()


def write_description(target: KVOffloadTarget, description: dict) -> None:
    """Leaves ``namespace.json`` beside the blocks, for whoever looks in the directory."""
    path = target.root / "namespace.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"namespace.json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(description, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
