"""Writes a Hugging Face model directory as a GGUF file laid out as llama.cpp's converter lays it
out for the model's family: llama.cpp's tensor names, q/k rows permuted for the families
llama.cpp converts as Llama, a layer's experts stacked in one tensor, Gemma's norms stored as
1 + weight, its window and layer pattern. For the tests' GGUF files (a small tokenizer of their
own) and for `pagoda bench random-model --gguf` (the default model's tokenizer, copied from its
GGUF file, so llama.cpp runs the file with the same token ids).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable

import numpy as np

#: The tensor types written here: floats, the quantized types the ``gguf`` package's own
#: quantizer makes, and Q4_K and Q6_K by :func:`quantize_q4_k` and :func:`quantize_q6_k` (the
#: tests' files; the benchmarks' K-quant files come from llama.cpp's quantizer).
TENSOR_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k")


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """A float [rows, cols] weight (cols a multiple of 256) as Q6_K blocks (uint8 [rows, cols /
    256 x 210]), rounded to nearest: per 16 values a scale (max |w| / 31) held as an int8 times
    the super-block's float16 d; not llama.cpp's search for the best scales."""
    rows, cols = weight.shape
    subs = weight.astype(np.float32).reshape(-1, 16, 16)  # [super-block, sub-block, 16]
    wanted = np.abs(subs).max(axis=2) / 31
    d = (wanted.max(axis=1) / 127).astype(np.float16)
    dd = d.astype(np.float32)[:, None]
    sc = np.where(dd > 0, np.round(wanted / np.where(dd > 0, dd, 1)), 0).clip(0, 127).astype(np.int8)
    step = (dd * sc)[:, :, None]
    q = np.where(step > 0, np.round(subs / np.where(step > 0, step, 1)), 0).clip(-32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # element 128 n + 32 c + l
    low, top = q & 0x0F, q >> 4
    ql = low[:, :, :2] | (low[:, :, 2:] << 4)  # runs of 32 bytes: c and c + 2's nibbles
    qh = top[:, :, 0] | top[:, :, 1] << 2 | top[:, :, 2] << 4 | top[:, :, 3] << 6
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)],
                            axis=1)
    return blocks.reshape(rows, -1)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """A float [rows, cols] weight (cols a multiple of 256) as Q4_K blocks (uint8 [rows, cols /
    256 x 144]), rounded to nearest: per 32 values a step (their range / 15) and a minimum
    (-min(0, their least)), each a 6-bit integer times the super-block's float16 d or dmin; not
    llama.cpp's search for the best ones."""
    rows, cols = weight.shape
    subs = weight.astype(np.float32).reshape(-1, 8, 32)  # [super-block, sub-block, 32]
    low = np.minimum(subs.min(axis=2), 0)
    steps, mins = (subs.max(axis=2) - low) / 15, -low
    d, dmin = ((t.max(axis=1) / 63).astype(np.float16) for t in (steps, mins))
    six = lambda t, unit: np.where(unit > 0, np.round(t / np.where(unit > 0, unit, 1)), 0).clip(0, 63)  # noqa: E731
    sc, mn = six(steps, d.astype(np.float32)[:, None]), six(mins, dmin.astype(np.float32)[:, None])
    step, least = (d.astype(np.float32)[:, None] * sc)[:, :, None], (dmin.astype(np.float32)[:, None] * mn)[:, :, None]
    q = np.where(step > 0, np.round((subs + least) / np.where(step > 0, step, 1)), 0).clip(0, 15).astype(np.uint8)
    q = q.reshape(-1, 4, 2, 32)  # element 64 c + 32 h + l
    qs = q[:, :, 0] | (q[:, :, 1] << 4)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=1)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales,
                             qs.reshape(-1, 128)], axis=1)
    return blocks.reshape(rows, -1)


def tokenizer_of(gguf_file: Path) -> Callable:
    """A function that adds to a GGUFWriter every ``tokenizer.*`` field of ``gguf_file``."""
    import gguf

    fields = [(name, field.contents(), field.types) for name, field in gguf.GGUFReader(str(gguf_file)).fields.items()
              if name.startswith("tokenizer.")]

    def add(writer, config: dict) -> None:
        tokens = next(len(value) for name, value, _ in fields if name == "tokenizer.ggml.tokens")
        if config["vocab_size"] != tokens:
            raise ValueError(f"{gguf_file} has a tokenizer of {tokens} tokens; the model's vocabulary is "
                             f"{config['vocab_size']}")
        for name, value, types in fields:
            writer.add_key_value(name, value, types[0], types[-1] if len(types) > 1 else None)

    return add


def write_gguf(model_dir: Path, path: Path, add_tokenizer: Callable, tensor_type: str = "f32") -> Path:
    """Writes ``model_dir`` (one ``model.safetensors``, or its shards) as a GGUF file at ``path``
    whose matrices are of ``tensor_type`` (one of TENSOR_TYPES; a quantized type for those whose
    rows are a multiple of 32 long, float32 for the rest), its tokenizer added by
    ``add_tokenizer(writer, config)``.

    Returns:
        ``path``.
    """
    import gguf
    from safetensors import safe_open

    from pagoda.engine.families import FAMILIES
    from pagoda.engine.model_loader import _GGUF_LAYER_NAMES, _GGUF_TOP_LEVEL_NAMES

    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor type {tensor_type!r}: expected one of {', '.join(TENSOR_TYPES)}")
    numpy_type = np.float16 if tensor_type == "f16" else np.float32
    quantized = gguf.GGMLQuantizationType[tensor_type.upper()] if tensor_type.startswith("q") else None
    config = json.loads((Path(model_dir) / "config.json").read_text())
    family = FAMILIES[config["model_type"]]
    arch = family.gguf_architecture
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    rope_factors: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]] = []
    if tensor_type != "f32":
        # (a file all of Q4_K is llama.cpp's Q4_K_S)
        file_type = f"MOSTLY_{tensor_type.upper()}" + ("_S" if tensor_type == "q4_k" else "")
        writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    writer.add_rope_dimension_count(int(head_dim * (rope.get("partial_rotary_factor")
                                                    or config.get("partial_rotary_factor") or 1.0)))
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
        # As llama.cpp's Phi-3 converter: the factors as tensors, the stretch's attention factor.
        original = config.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
        stretch = config["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(stretch) / math.log(original)) if stretch > 1
                                             else 1.0)
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            rope_factors.append((f"rope_factors_{kind}.weight", factors.shape, lambda factors=factors: factors))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if family.moe:
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if family.gguf_norm_offset:  # Gemma: its window, its layers' pattern and soft caps, as llama.cpp's converter
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(key) is not None:
                getattr(writer, f"add_{key}")(config[key])
    add_tokenizer(writer, config)

    # NOTE: tensor by tensor, read from the checkpoint as written (an 8B model's file is larger
    # than this machine's memory): every tensor's info first, then each one's data in order.
    handles = [safe_open(str(file), framework="pt") for file in sorted(Path(model_dir).glob("*.safetensors"))]
    where = {name: handle for handle in handles for name in handle.keys()}
    top_level = {hf: ours for ours, hf in _GGUF_TOP_LEVEL_NAMES.items()}
    layer_names = {**_GGUF_LAYER_NAMES, **dict(family.gguf_names)}
    patterns = [(re.compile(r"model\.layers\.(\d+)\." + re.escape(hf).replace(r"\{\}", r"(\d+)") + r"\.(\w+)$"), ours)
                for ours, hf in layer_names.items()]
    entries: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]] = list(rope_factors)  # name, shape, data
    stacked: dict[str, dict[int, str]] = {}

    def read(name: str) -> np.ndarray:
        tensor = where[name].get_tensor(name)
        if name.endswith("norm.weight"):
            tensor = tensor + family.gguf_norm_offset  # Gemma's norms are stored as 1 + weight
        return tensor.float().numpy()

    def permuted(ours: str, tensor: np.ndarray) -> np.ndarray:
        # llama.cpp's permute for its interleaved RoPE: rows (heads, 2, d/2) -> (heads, d/2, 2).
        n = {"attn_q": heads, "attn_k": kv_heads}.get(ours)
        if not family.gguf_permutes_qk or n is None:
            return tensor
        return tensor.reshape(n, 2, tensor.shape[0] // n // 2, *tensor.shape[1:]).swapaxes(1, 2).reshape(tensor.shape)

    for name in sorted(where):
        shape = tuple(where[name].get_slice(name).get_shape())
        if name in top_level:
            entries.append((top_level[name], shape, lambda name=name: read(name)))
            continue
        for pattern, ours in patterns:
            match = pattern.match(name)
            if match is None:
                continue
            if "{}" in layer_names[ours]:
                layer, expert, kind = match.groups()
                stacked.setdefault(f"blk.{layer}.{ours}.{kind}", {})[int(expert)] = name
            else:
                layer, kind = match.groups()
                entries.append((f"blk.{layer}.{ours}.{kind}", shape,
                                lambda name=name, ours=ours: permuted(ours, read(name))))
            break
        else:
            raise ValueError(f"no GGUF name for {name}")
    for name, experts in stacked.items():
        names = [experts[e] for e in sorted(experts)]
        shape = (len(names), *where[names[0]].get_slice(names[0]).get_shape())
        entries.append((name, shape, lambda names=names: np.stack([read(n) for n in names])))

    def encoding(shape: tuple[int, ...]) -> gguf.GGMLQuantizationType | np.dtype:
        # NOTE: norms and biases (1-D) stay float32, as llama.cpp's converter keeps them
        if len(shape) == 1:
            return np.dtype(np.float32)
        if quantized is not None and shape[-1] % (256 if quantized.name.endswith("_K") else 32) == 0:
            return quantized
        return np.dtype(numpy_type)

    ours = {gguf.GGMLQuantizationType.Q6_K: quantize_q6_k, gguf.GGMLQuantizationType.Q4_K: quantize_q4_k}

    def encoded(data: np.ndarray) -> np.ndarray:
        kind = encoding(data.shape)
        if kind in ours:
            return ours[kind](data.reshape(-1, data.shape[-1])).reshape(*data.shape[:-1], -1)
        if isinstance(kind, gguf.GGMLQuantizationType):
            return gguf.quants.quantize(data.astype(np.float32), kind)
        return data.astype(kind)

    for name, shape, _ in entries:
        kind = encoding(shape)
        if isinstance(kind, gguf.GGMLQuantizationType):
            stored = gguf.quants.quant_shape_to_byte_shape(shape, kind)
            writer.add_tensor_info(name, stored, np.dtype(np.uint8), math.prod(stored), raw_dtype=kind)
        else:
            writer.add_tensor_info(name, shape, kind, math.prod(shape) * kind.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, data in entries:
        writer.write_tensor_data(encoded(data()))
    writer.close()
    return Path(path)
