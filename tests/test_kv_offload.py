"""The prefix cache's disk tier (engine/kv_offload.py): blocks written as they are cached, read
back after an eviction or a restart with the same outputs as the pool's own hits; damaged,
truncated or foreign files skipped (and the tokens computed); the directory kept within its
budget; the index's scan and eviction order."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.core.kv_offload_index import KVTierIndex
from pagoda.engine.kv_offload import HEADER, KVOffloadTarget, block_digest
from helpers import TINY_FLAGS, ServerProcess, make_tiny_model_dir

BLOCK = 16
PROMPT = [(7 * i) % 4000 + 100 for i in range(203)]  # 12 full blocks before the last token
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=3)


def _files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kv"))


def _wait_for_files(directory: Path, count: int, timeout: float = 20.0) -> list[Path]:
    deadline = time.time() + timeout
    while len(_files(directory)) < count:
        assert time.time() < deadline, f"{len(_files(directory))} block files, {count} expected"
        time.sleep(0.05)
    return _files(directory)


def _llm(model_dir: Path, offload_dir: Path | None, **kwargs) -> LLM:
    if offload_dir is not None:
        kwargs["kv_offload_dir"] = str(offload_dir)
    llm = LLM(str(model_dir), num_kv_blocks=48, max_model_len=512, enforce_eager=True, dtype="float32",
              block_size=BLOCK, **kwargs)
    # NOTE: the tiny model computes a block faster than a file is read (the rates' comparison
    # would compute them once measured): these tests read every block found.
    llm.engine.scheduler.kv_cache_manager.offload.worth_loading = lambda: True
    return llm


def _answer(llm: LLM, prompt=PROMPT):
    output = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    sample = output.outputs[0]
    return list(sample.token_ids), [entry.logprob for entry in sample.logprobs], output.metrics.num_cached_tokens


def _evict_everything(llm: LLM) -> None:
    assert llm.engine.scheduler.kv_cache_manager.reset_prefix_cache() > 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("offload-model"), seed=3)


def test_a_prefix_evicted_from_the_pool_is_read_back_with_the_pools_own_answer(model_dir, tmp_path):
    with _llm(model_dir, tmp_path) as llm:
        computed = _answer(llm)
        assert computed[2] == 0
        from_pool = _answer(llm)
        assert from_pool[2] == 192  # every full block but the one holding the last token
        _wait_for_files(tmp_path, 12)
        _evict_everything(llm)
        from_disk = _answer(llm)
        stats = llm.engine.scheduler.stats
        offload = llm.engine.scheduler.kv_cache_manager.offload.stats
    assert from_disk[2] == 192 and stats.num_prompt_tokens_loaded == 192
    assert offload.num_loaded == 12 and offload.num_load_failures == 0 and offload.bytes_read > 0
    # NOTE: the same bytes as the pool's blocks: the same answer as the pool's hit, to the bit.
    assert from_disk[:2] == from_pool[:2]
    assert from_disk[0] == computed[0]


def test_host_memory_alone_or_in_front_of_the_disk_serves_the_evicted_prefix(model_dir, tmp_path):
    with _llm(model_dir, None, kv_offload_host_bytes=1 << 20) as llm:  # a tier of its own: no files
        from_pool = (_answer(llm), _answer(llm))[1]
        offload = llm.engine.scheduler.kv_cache_manager.offload
        file_bytes = offload.file_bytes
        assert offload.target is None and offload.max_files == (1 << 20) // file_bytes
        _answer(llm, [5] * 300)  # a step after the prompt's: its last blocks are stored
        _evict_everything(llm)
        from_host = _answer(llm)
        assert offload.stats.num_loaded == 12
    assert from_host[2] == 192 and from_host[:2] == from_pool[:2]
    assert not list(tmp_path.iterdir())

    with _llm(model_dir, tmp_path, kv_offload_host_bytes=64 * file_bytes) as llm:
        from_pool = (_answer(llm), _answer(llm))[1]
        for path in _wait_for_files(tmp_path, 12):
            path.unlink()  # NOTE: what is read back now can only come from host memory
        _evict_everything(llm)
        from_host = _answer(llm)
        assert llm.engine.scheduler.kv_cache_manager.offload.stats.num_load_failures == 0
    assert from_host[2] == 192 and from_host[:2] == from_pool[:2]


@pytest.mark.slow  # NOTE: several engines started; `python -m pytest -m slow` runs it
def test_a_restart_finds_the_blocks_and_damaged_or_foreign_files_are_never_used(model_dir, tmp_path):
    with _llm(model_dir, tmp_path) as llm:
        computed = _answer(llm)
        from_pool = _answer(llm)
        files = _wait_for_files(tmp_path, 12)
    with _llm(model_dir, tmp_path) as llm:  # a new engine and worker: the pool starts empty
        assert llm.engine.scheduler.kv_cache_manager.offload.num_files >= 12
        after_restart = _answer(llm)
    assert after_restart[2] == 192 and after_restart[:2] == from_pool[:2]

    # The 3rd block's payload damaged, the 6th cut short, the 9th replaced by a block of another
    # model (same name, its header names another namespace).
    by_position = _chain_files(tmp_path, PROMPT)
    assert set(by_position) <= set(files)
    damaged = bytearray(by_position[2].read_bytes())
    damaged[HEADER.size + 5] ^= 0xFF
    by_position[2].write_bytes(bytes(damaged))
    other = make_tiny_model_dir(tmp_path / "other-model", seed=4)
    other_dir = tmp_path / "other-offload"
    with _llm(other, other_dir) as other_llm:
        _answer(other_llm)
        foreign = _chain_files(other_dir, PROMPT)
    assert foreign[8].read_bytes()[HEADER.size:] != by_position[8].read_bytes()[HEADER.size:]
    by_position[8].write_bytes(foreign[8].read_bytes())
    with _llm(model_dir, tmp_path) as llm:
        by_position[5].write_bytes(by_position[5].read_bytes()[:-100])  # after the start's scan
        loaded = _answer(llm)
        stats = llm.engine.scheduler.kv_cache_manager.offload.stats
        assert stats.num_load_failures == 1 and stats.num_loaded == 2  # the run stops at the damaged block
        assert loaded[2] == 2 * BLOCK
        _evict_everything(llm)
        again = _answer(llm)  # the damaged file was deleted and the block written again, computed
    assert not by_position[2].exists() or by_position[2].read_bytes() != bytes(damaged)
    assert loaded[0] == computed[0] and again[0] == computed[0]
    assert again[2] >= 5 * BLOCK  # stops at the truncated one
    with _llm(model_dir, tmp_path) as llm:
        found_foreign = _answer(llm)  # read up to the other model's block: it is found out there
        assert llm.engine.scheduler.kv_cache_manager.offload.stats.num_load_failures == 1
    assert found_foreign[2] == 8 * BLOCK and found_foreign[0] == computed[0]
    assert not foreign[8].exists() or by_position[8].read_bytes() != foreign[8].read_bytes()
    with _llm(model_dir, tmp_path) as llm:
        final = _answer(llm)  # every block whole again
    assert final[2] == 192 and final[0] == computed[0]


def _chain_files(offload_dir: Path, prompt: list[int]) -> list[Path]:
    """The files of a prompt's full blocks, in order (one namespace in ``offload_dir``)."""
    (root,) = [p for p in offload_dir.iterdir() if p.is_dir() and (p / "namespace.json").exists()]
    target = KVOffloadTarget(offload_dir, bytes.fromhex(root.name))
    digests, parent = [], None
    for i in range((len(prompt) - 1) // BLOCK):
        parent = block_digest(parent, prompt[i * BLOCK:(i + 1) * BLOCK], None)
        digests.append(target.path_of(parent))
    return digests


def test_another_model_reads_nothing(model_dir, tmp_path):
    with _llm(model_dir, tmp_path) as llm:
        _answer(llm)
        _wait_for_files(tmp_path, 12)
    other = make_tiny_model_dir(tmp_path / "other", seed=5)
    with _llm(other, tmp_path) as llm:
        assert llm.engine.scheduler.kv_cache_manager.offload.num_files == 0
        assert _answer(llm)[2] == 0
    assert len([p for p in tmp_path.iterdir() if (p / "namespace.json").exists()]) == 2


@pytest.mark.slow  # NOTE: several engines started; `python -m pytest -m slow` runs it
def test_the_directory_stays_within_its_budget(model_dir, tmp_path):
    file_bytes = None
    with _llm(model_dir, tmp_path) as llm:
        file_bytes = llm.engine.scheduler.kv_cache_manager.offload.file_bytes
    budget = 20 * file_bytes
    with _llm(model_dir, tmp_path, kv_offload_bytes=budget) as llm:
        for k in range(4):
            llm.generate([[t + k for t in PROMPT]], GREEDY, use_tqdm=False)
        offload = llm.engine.scheduler.kv_cache_manager.offload
        assert offload.num_files == 20 and offload.stats.num_deleted == 4 * 13 - 20  # 12 blocks of prompt, 1 of output each
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)  # a step that carries the last deletes
        deadline = time.time() + 20
        while len(_files(tmp_path)) > 20:
            assert time.time() < deadline, len(_files(tmp_path))
            time.sleep(0.05)
        # The newest prompt's blocks stayed (least recently used go first).
        assert _answer(llm, [t + 3 for t in PROMPT])[2] == 192


def test_the_index_scans_what_is_there_and_evicts_the_oldest_first(tmp_path):
    target = KVOffloadTarget(tmp_path, b"\x01" * 16)
    digests = [bytes([i]) * 16 for i in range(5)]
    for age, digest in enumerate(digests):
        path = target.path_of(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 + age, 1000 + age))
    wrong_size = target.path_of(b"\x09" * 16)
    wrong_size.parent.mkdir(parents=True, exist_ok=True)
    wrong_size.write_bytes(b"x" * 99)
    stale = target.path_of(digests[0]).with_name("leftover.kv.123.tmp")
    stale.write_bytes(b"x")
    os.utime(stale, (1000, 1000))
    index = KVTierIndex(target, file_bytes=100, max_bytes=300, block_size=BLOCK)
    assert index.scan() == 3
    assert not wrong_size.exists() and not stale.exists()
    assert [target.path_of(d).exists() for d in digests] == [False, False, True, True, True]
    index.block_cached(7, b"\x0a" * 16, 0)  # a new block: stored, the oldest file goes
    assert index.take() == ([(7, b"\x0a" * 16)], [digests[2]])
    index.used(digests[3])
    index.block_cached(8, b"\x0b" * 16, 0)
    assert index.take()[1] == [digests[4]]  # 3 was read back: 4 is the least recently used now
    assert index.has(digests[3]) and not index.has(digests[4])


def test_reading_is_chosen_only_when_it_beats_computing(tmp_path):
    index = KVTierIndex(KVOffloadTarget(tmp_path, b"\x02" * 16), file_bytes=1 << 20, max_bytes=1 << 30,
                          block_size=BLOCK)
    assert index.worth_loading()  # nothing measured yet
    index.record_read(100 << 20, 0.1)  # 1 GB/s: a block in 1 ms
    index.record_prefill(8000, 1.0)  # a block of 16 tokens in 2 ms
    assert index.worth_loading()
    for _ in range(20):
        index.record_prefill(80000, 1.0)  # 0.2 ms
    assert not index.worth_loading()


def test_digests_chain_the_prefix_and_the_salt():
    first = block_digest(None, list(range(16)), None)
    assert first == block_digest(None, list(range(16)), None)
    assert first != block_digest(None, list(range(16)), "salt")
    assert block_digest(first, [1] * 16, None) != block_digest(block_digest(None, [0] * 16, None), [1] * 16, None)


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="kv_offload_dir"):
        EngineConfig(kv_offload_bytes=1 << 20)
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(kv_offload_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor-parallel"):
        EngineConfig(kv_offload_dir=str(tmp_path), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="Ray"):
        EngineConfig(kv_offload_host_bytes=1 << 30, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="kv_offload_host_bytes must be a positive integer"):
        EngineConfig(kv_offload_host_bytes=-1)


@pytest.mark.slow
def test_a_killed_server_restarts_with_its_prefix_cache_and_skips_damaged_files(tiny_llama_dir, tmp_path):
    """The must-show: a long prefix served, `pagoda serve` SIGKILLed and started again: the same
    prompt's tokens come from the disk (usage's cached_tokens) and its output is the same; then
    every file damaged: none is used, the output is still the same."""
    offload = tmp_path / "kv"
    args = [str(tiny_llama_dir), *TINY_FLAGS, "--kv-offload-dir", str(offload)]
    prompt = " ".join(f"item{i}" for i in range(60))

    def ask(server):
        answer = server.client().completions.create(model=str(tiny_llama_dir), prompt=prompt, max_tokens=8,
                                                    temperature=0, logprobs=2)
        return answer.choices[0].text, answer.usage.prompt_tokens_details.cached_tokens, answer.usage.prompt_tokens

    first = ServerProcess(args, tmp_path / "first.log")
    try:
        first.wait_ready(120)
        text, cached, num_prompt = ask(first)
        assert cached == 0 and num_prompt > 100
        files = _wait_for_files(offload, (num_prompt - 1) // 8)
    finally:
        first.close()  # SIGKILL to the whole group: engine and worker
    assert first.proc.returncode == -9

    second = ServerProcess(args, tmp_path / "second.log")
    try:
        second.wait_ready(120)
        assert ask(second) == (text, (num_prompt - 1) // 8 * 8, num_prompt)
    finally:
        second.close()

    for path in files:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x55
        path.write_bytes(bytes(data))
    third = ServerProcess(args, tmp_path / "third.log")
    try:
        third.wait_ready(120)
        assert ask(third) == (text, 0, num_prompt)
        assert "its checksum does not match; deleted" in third.log()
    finally:
        third.close()


@pytest.mark.slow  # NOTE: several engines started; `python -m pytest -m slow` runs it
def test_a_restarted_worker_reads_the_prefix_its_predecessor_wrote(model_dir, tmp_path):
    with _llm(model_dir, tmp_path) as llm:
        computed = _answer(llm)
        _wait_for_files(tmp_path, 12)
        llm.engine.core.worker.kill()
        after = _answer(llm)  # the death is noticed, a new worker starts with an empty pool
        assert llm.engine.core.num_worker_restarts == 1
        assert llm.engine.scheduler.kv_cache_manager.offload.stats.num_loaded == 12
    assert after[0] == computed[0]
