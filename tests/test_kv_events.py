"""KV cache events (engine/kv_events.py): the block pool's stores, evictions and resets as vLLM's
BlockStored / BlockRemoved / AllBlocksCleared, published over ZMQ in vLLM's frames and encoding
to a real subscriber while a real engine runs, replayed to a late one; bad configurations refused."""

from __future__ import annotations

import threading

import msgpack
import pytest
import zmq

from pagoda import LLM, SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.core.block_pool import BlockPool
from pagoda.engine.kv_events import KVEventBatch, KVEventLog, KVEventsConfig, ZmqEventPublisher
from helpers import free_port

BLOCK = 4


def test_the_pool_records_stores_evictions_and_resets():
    pool = BlockPool(4)
    pool.events = log = KVEventLog(BLOCK)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 11, (None, (1, 2, 3, 4), ()))
    pool.cache_block(b, 12, (11, (5, 6, 7, 8)))  # the chain goes on: one event
    pool.cache_block(c, 99, (None, (9, 9, 9, 9), ()))  # a new chain: a second one
    pool.cache_block(c, 99, (None, (9, 9, 9, 9), ()))  # cached already: nothing
    wire = KVEventBatch(1.5, log.take()).to_wire()
    assert wire == [1.5, [["BlockStored", [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], BLOCK, None, "CPU"],
                          ["BlockStored", [99], None, [9, 9, 9, 9], BLOCK, None, "CPU"]]]
    pool.free_blocks([c, b, a])
    assert pool.get_new_blocks(4) is not None  # one uncached block, then three evictions, deepest first
    assert KVEventBatch(2.0, log.take()).to_wire()[1] == [["BlockRemoved", [99, 12, 11], "CPU"]]
    pool.reset()
    assert KVEventBatch(3.0, log.take()).to_wire()[1] == [["AllBlocksCleared"]]
    assert log.take() == []


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="unknown field"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "port": 1})
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig(kv_events_config="{nope")
    with pytest.raises(ValueError, match="publisher"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "publisher": "kafka"})
    port = free_port()
    first = ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}"))
    try:
        with pytest.raises(ValueError, match="cannot bind"):
            ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}"))
    finally:
        first.shutdown()


def _decode(frames):
    topic, seq, payload = frames
    ts, events = msgpack.unpackb(payload)
    return topic, int.from_bytes(seq, "big", signed=True), events


def test_a_subscriber_follows_the_cache_and_a_late_one_gets_the_replay(tiny_llama_dir):
    port, replay_port = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv"}
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    received, stop = [], threading.Event()

    def listen():
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(50):
                received.append(_decode(sub.recv_multipart()))

    prompt = list(range(300, 322))  # five whole blocks of 4 and two tokens
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    # NOTE: 12 blocks: the second prompt's blocks evict the first's.
    with LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, block_size=BLOCK, num_kv_blocks=12,
             max_model_len=48, kv_events_config=config) as llm:
        sub.connect(f"tcp://127.0.0.1:{port}")
        listener = threading.Thread(target=listen)
        listener.start()
        try:
            import time

            time.sleep(0.3)  # NOTE: a PUB socket drops what it sends before the subscriber has joined
            llm.generate([prompt], params)
            llm.generate([list(range(500, 540))], params)
            deadline = time.time() + 10
            while time.time() < deadline and not any(e[0] == "BlockRemoved" for _, _, events in received
                                                     for e in events):
                time.sleep(0.05)
        finally:
            stop.set()
            listener.join()
        # A late subscriber asks for everything from the first batch on.
        replay = context.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart((b"", (0).to_bytes(8, "big", signed=True)))
        replayed = []
        while True:
            assert replay.poll(5000), "no replay answer"
            _, seq, payload = replay.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big", signed=True), msgpack.unpackb(payload)[1]))
    context.destroy(linger=0)
    assert received and all(topic == b"kv" for topic, _, _ in received)
    seqs = [seq for _, seq, _ in received]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # in order, none lost
    stored = [e for _, _, events in received for e in events if e[0] == "BlockStored"]
    first = stored[0]
    # The prompt's five whole blocks, chained, their tokens the prompt's.
    hashes = [h for e in stored for h in e[1]]
    assert first[2] is None and first[4] == BLOCK and first[3] == prompt[:len(first[1]) * BLOCK]
    assert len(hashes) == len(set(hashes)) and len(hashes) >= 5 + 10
    removed = [h for _, _, events in received for e in events if e[0] == "BlockRemoved" for h in e[1]]
    assert removed and set(removed) <= set(hashes)
    # The replay holds what the live subscriber saw, with the same numbers.
    assert [seq for seq, _ in replayed][-len(received):] == seqs
    assert [events for _, events in replayed][-len(received):] == [events for _, _, events in received]


def test_the_offload_tier_reports_its_blocks_under_their_pool_hashes(tmp_path):
    from pagoda.engine.core.kv_cache_manager import KVCacheManager
    from pagoda.engine.core.kv_offload_index import KVTierIndex
    from pagoda.engine.core.request import Request
    from pagoda.engine.kv_offload import KVOffloadTarget
    from pagoda.engine.sampling_params import SamplingParams

    kv = KVCacheManager(8, BLOCK)
    kv.block_pool.events = log = KVEventLog(BLOCK)
    kv.offload = tier = KVTierIndex(KVOffloadTarget(tmp_path, b"\x03" * 16), file_bytes=10, max_bytes=20,
                                    block_size=BLOCK)
    tier.events = log
    request = Request("r", list(range(1, 10)), SamplingParams(max_tokens=1), 1)
    kv.allocate_slots(request, 9)  # two full blocks: in the pool, and sent to the disk tier
    hashes = [h for h, _ in kv.block_hashes(request, 2)]
    wire = KVEventBatch(1.0, log.take()).to_wire()[1]
    assert [(e[0], e[1], e[-1]) for e in wire] == [("BlockStored", hashes, "CPU"), ("BlockStored", hashes, "DISK")]
    tier.block_cached(5, b"\x07" * 16, 0, 12345, (hashes[1], (9, 9, 9, 9), ()))  # a third file: the oldest goes
    wire = KVEventBatch(2.0, log.take()).to_wire()[1]
    assert wire == [["BlockStored", [12345], hashes[1], [9, 9, 9, 9], BLOCK, None, "DISK"],
                    ["BlockRemoved", [hashes[0]], "DISK"]]
