"""KV cache events: what the prefix cache stored and dropped, step by step, for routers.

vLLM's event kinds and fields: ``BlockStored`` (the block hashes, the parent's hash, the token
ids, the block size, the adapter, the medium), ``BlockRemoved`` (hashes, medium) and
``AllBlocksCleared``. The block pool records them as they happen (:class:`KVEventLog`), the
step loop takes each step's events as one batch, and a publisher (engine/frontend/kv_events.py)
sends the batch to subscribers. Mechanism only, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The medium a block lives in (vLLM's ``medium`` field): the worker's KV pool on the CPU; the
#: prefix cache's offload tier on disk, or in the worker's host memory alone.
MEDIUM = "CPU"
DISK_MEDIUM = "DISK"
HOST_MEDIUM = "HOST"


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """One step's events, in the order they happened; ``ts`` in ``time.time()`` seconds."""

    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)

    def to_wire(self) -> list:
        """The batch as vLLM's subscribers decode it (msgspec's array-like structs, each event
        tagged by its class name): ``[ts, [[tag, field, ...], ...]]``."""
        events = []
        for event in self.events:
            if isinstance(event, BlockStored):
                events.append(["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids,
                               event.block_size, event.lora_id, event.medium])
            elif isinstance(event, BlockRemoved):
                events.append(["BlockRemoved", event.block_hashes, event.medium])
            else:
                events.append(["AllBlocksCleared"])
        return [self.ts, events]


class KVEventLog:
    """The events the block pool records until the step loop takes them.

    A block's hash is Pagoda's own (a hash of its key: the parent's hash, its token ids and
    the first block's extra keys, such as a cache salt or an adapter), the same for the same
    prefix in every replica of one model.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[KVCacheEvent] = []

    def stored(self, block_hash: int, block_key: tuple, medium: str = MEDIUM) -> None:
        parent, token_ids = block_key[0], block_key[1]
        last = self.events[-1] if self.events else None
        # NOTE: a chain of blocks stored together is one event, as vLLM sends it.
        if (isinstance(last, BlockStored) and last.medium == medium and last.block_hashes[-1] == parent
                and len(last.token_ids) < 64 * self.block_size):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self.events.append(BlockStored([block_hash], parent, list(token_ids), self.block_size, medium=medium))

    def removed(self, block_hash: int, medium: str = MEDIUM) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config``: whether the engine publishes KV events, and where.

    Attributes:
        enable_kv_cache_events: Publish at all.
        publisher: "zmq", or "null" (recorded, sent nowhere: for tests and dry runs).
        endpoint: Where the ZMQ PUB socket binds (subscribers connect to it).
        replay_endpoint: Where a ZMQ ROUTER socket binds for late subscribers to ask for the
            batches they missed, by sequence number (None: no replay).
        buffer_steps: Batches kept for replay.
        hwm: The PUB socket's send high-water mark (messages queued per slow subscriber).
        topic: The first frame of every message.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, value) -> KVEventsConfig | None:
        """A config from a dict, its JSON, or one already made; None stays None.

        Raises:
            ValueError: Not JSON, an unknown field, or a bad value (the message names it).
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"kv_events_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object; got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        config = cls(**value)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null'; got {config.publisher!r}")
        if not isinstance(config.buffer_steps, int) or config.buffer_steps < 1:
            raise ValueError(f"kv_events_config: buffer_steps must be a positive integer; got {config.buffer_steps!r}")
        return config


class NullEventPublisher:
    """Keeps the batches it is given (the last ``buffer_steps``), sends them nowhere."""

    def __init__(self, config: KVEventsConfig) -> None:
        from collections import deque

        self.batches: deque[KVEventBatch] = deque(maxlen=config.buffer_steps)

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass


class ZmqEventPublisher:
    """Sends each batch on a ZMQ PUB socket as vLLM does: the frames (topic, sequence number as
    8 big-endian bytes, the batch in msgpack), from a thread of its own so the step loop never
    waits on a socket. With a replay endpoint, a late subscriber sends a sequence number (8
    big-endian bytes) to the ROUTER socket and gets every kept batch from it on, each as
    (sequence, payload), then (-1, empty).

    Raises:
        ValueError: pyzmq or msgpack is not installed, or an endpoint cannot be bound.
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig) -> None:
        import queue
        import threading
        from collections import deque

        try:
            import msgpack
            import zmq
        except ImportError as exc:
            raise ValueError(f"KV events over ZMQ need pyzmq and msgpack ({exc}): pip install pyzmq msgpack") from None
        self._zmq, self._pack = zmq, msgpack.packb
        self._context = zmq.Context()
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._queue: queue.Queue = queue.Queue()
        self._seq = 0
        try:
            self._pub = self._context.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.bind(config.endpoint)
            self._replay = None
            if config.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._context.destroy(linger=0)
            raise ValueError(f"kv_events_config: cannot bind {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        self._queue.put(batch)

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        import queue

        poller = self._zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, self._zmq.POLLIN)
        while True:
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                batch = ...
            if batch is None:
                return
            if batch is not ...:
                payload = self._pack(batch.to_wire())
                seq = self._seq
                self._seq += 1
                self._buffer.append((seq, payload))
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big", signed=True), payload))
            if self._replay is not None and poller.poll(0):
                self._serve_replay()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # NOTE: not the replay protocol: ignored, as vLLM ignores it
        client, _, start = frames
        start_seq = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big", signed=True), payload))
        self._replay.send_multipart((client, b"", self.END_SEQ, b""))


def make_publisher(config: KVEventsConfig):
    """The publisher ``config`` names."""
    return NullEventPublisher(config) if config.publisher == "null" else ZmqEventPublisher(config)
