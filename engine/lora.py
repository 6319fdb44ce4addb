"""LoRA adapters in the PEFT format, read and checked in the engine process.

An adapter directory holds ``adapter_config.json`` (rank ``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``) and ``adapter_model.safetensors`` (or ``.bin``) with one
``lora_A`` ([r, in]) and one ``lora_B`` ([out, r]) per adapted layer, named after the base
model's modules (``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``). Every
check (the format, the rank against ``--max-lora-rank``, that each target is a projection
the model has, with the shapes it has) happens here, before a request can name the adapter;
the worker takes the tensors as they are sent (engine/models/lora.py).

A layer's delta is ``scaling * (x @ A.T) @ B.T`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA), as PEFT computes it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagoda.engine.kv_offload import model_fingerprint
from pagoda.engine.model_config import ModelConfig

#: The projections an adapter may target, with the decoder's fused layer each one is part of.
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served: the message says which and why."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's offline ``LoRARequest``): its name, a number
    unique to it (vLLM's ``lora_int_id``; unused by Pagoda beyond being kept) and its directory."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(eq=False)
class LoRAAdapter:
    """An adapter checked against the model, its tensors in host memory.

    Attributes:
        id: Unique in this engine (a reload under the same name gets a new one).
        name: What requests call it (their ``model``).
        path: Its directory.
        rank: The largest rank of its layers.
        weights: Per adapted projection ("layers.3.self_attn.q_proj"), (A, B * scaling), in float32.
        fingerprint: A digest of its files (engine/kv_offload.py's model_fingerprint).
        cache_key: What keeps its prefix-cache blocks apart from other adapters' (its name,
            path and fingerprint: an adapter rewritten in place never reads the old one's
            blocks, in the pool or on disk).
    """

    id: int
    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    fingerprint: str = ""

    def __getstate__(self) -> dict:
        # NOTE: as numpy arrays: torch's pickling of tensors over a multiprocessing pipe
        # shares them by file descriptor, which a worker not forked by multiprocessing cannot take.
        state = dict(self.__dict__)
        state["weights"] = {k: (a.numpy(), b.numpy()) for k, (a, b) in self.weights.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        state["weights"] = {k: (torch.from_numpy(a), torch.from_numpy(b)) for k, (a, b) in state["weights"].items()}
        self.__dict__.update(state)

    @property
    def cache_key(self) -> str:
        return f"lora:{self.name}:{self.path}:{self.fingerprint}"



_ids = itertools.count(1)


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection an adapter may target, for a dense layer."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def _read_config(directory: Path) -> dict:
    path = directory / "adapter_config.json"
    if not directory.is_dir():
        raise LoRAError(f"LoRA adapter directory {str(directory)!r} does not exist")
    if not path.is_file():
        raise LoRAError(f"{str(directory)!r} is not a LoRA adapter: it has no adapter_config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{path}: expected a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRAError(f"{path}: peft_type {kind!r} is not LoRA")
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (whole layers trained "
                                                                 "beside the adapter)"),
                      ("alpha_pattern", "alpha_pattern"), ("fan_in_fan_out", "fan_in_fan_out")):
        if config.get(key):
            raise LoRAError(f"{path}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{path}: bias {config['bias']!r} is not supported (only 'none')")
    if not isinstance(config.get("r", 8), int) or not isinstance(config.get("lora_alpha", 8), (int, float)):
        raise LoRAError(f"{path}: 'r' must be an integer and 'lora_alpha' a number")
    return config


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    safetensors_path, bin_path = directory / "adapter_model.safetensors", directory / "adapter_model.bin"
    try:
        if safetensors_path.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_path))
        if bin_path.is_file():
            return torch.load(str(bin_path), map_location="cpu", weights_only=True)
    except Exception as exc:  # NOTE: a truncated or foreign file: safetensors' and torch's errors vary
        raise LoRAError(f"{directory}: the adapter's weights cannot be read ({exc})") from None
    raise LoRAError(f"{str(directory)!r} has no adapter_model.safetensors (nor adapter_model.bin)")


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter at ``path`` for the model of ``config``.

    Raises:
        LoRAError: The directory is missing or malformed, a rank exceeds ``max_rank``, or a
            tensor names a module the model lacks or has the wrong shape.
    """
    if not name or not isinstance(name, str):
        raise LoRAError("a LoRA adapter needs a name")
    directory = Path(path).expanduser()
    adapter_config = _read_config(directory)
    scale_by_sqrt = bool(adapter_config.get("use_rslora"))
    alpha = float(adapter_config.get("lora_alpha", 8))
    shapes = projection_shapes(config)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(directory).items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"{directory}: tensor {key!r} is not a LoRA weight of a layer's projection "
                            f"(supported targets: {', '.join(TARGETS)})")
        layer, block, module, half = int(match[1]), match[2], match[3], match[4]
        if module not in TARGETS or TARGETS[module] != block:
            raise LoRAError(f"{directory}: target module {block}.{module} is not supported "
                            f"(supported: {', '.join(TARGETS)})")
        if layer >= config.num_hidden_layers:
            raise LoRAError(f"{directory}: layer {layer} is past the model's {config.num_hidden_layers} layers")
        if block == "mlp" and config.layer_is_moe(layer):
            raise LoRAError(f"{directory}: layer {layer}'s MLP is a mixture of experts; LoRA on experts is not "
                            "supported")
        halves.setdefault(f"layers.{layer}.{block}.{module}", {})[half] = tensor
    if not halves:
        raise LoRAError(f"{directory}: the adapter has no LoRA weights")
    weights, rank = {}, 0
    for target, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{directory}: {target} has lora_{'A' if 'A' not in pair else 'B'} missing")
        a, b = pair["A"].float(), pair["B"].float()
        out_features, in_features = shapes[target.rsplit(".", 1)[1]]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, r):
            raise LoRAError(f"{directory}: {target} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the "
                            f"model needs [r, {in_features}] and [{out_features}, r]")
        if r > max_rank:
            raise LoRAError(f"{directory}: rank {r} ({target}) is above --max-lora-rank {max_rank}")
        scaling = alpha / (math.sqrt(r) if scale_by_sqrt else r)
        weights[target] = (a.contiguous(), (b * scaling).contiguous())
        rank = max(rank, r)
    return LoRAAdapter(next(_ids), name, str(directory), rank, weights, model_fingerprint(directory))


def prefix_salt(cache_salt: str | None, adapter: LoRAAdapter | None) -> str | None:
    """A request's prefix-cache salt with its adapter in it: two adapters never share a
    cached block (their K/V differ), the same adapter does."""
    if adapter is None:
        return cache_salt
    return f"{adapter.cache_key}\x00{cache_salt or ''}"


def parse_lora_modules(values) -> list[tuple[str, str]]:
    """``--lora-modules`` entries as (name, path): ``name=path`` or vLLM's JSON form
    ``{"name": ..., "path": ...}``.

    Raises:
        LoRAError: An entry of neither form.
    """
    modules = []
    for value in values or ():
        value = value.strip()
        if value.startswith("{"):
            try:
                entry = json.loads(value)
                modules.append((str(entry["name"]), str(entry["path"])))
            except (ValueError, KeyError, TypeError):
                raise LoRAError(f"--lora-modules {value!r}: expected name=path or "
                                '{"name": ..., "path": ...}') from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise LoRAError(f"--lora-modules {value!r}: expected name=path")
        modules.append((name, path))
    return modules


class LoRARegistry:
    """The adapters requests may name, by name (the engine process's copy of their tensors)."""

    def __init__(self, config: ModelConfig, max_rank: int) -> None:
        self.config = config
        self.max_rank = max_rank
        self.adapters: dict[str, LoRAAdapter] = {}

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Reads, checks and registers an adapter (a thread may run it: the server reads adapters
        off its event loop).

        Raises:
            LoRAError: The name is taken (also by a load that finished meanwhile), or the adapter
                cannot be served (load_adapter).
        """
        taken = LoRAError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
        if name in self.adapters:
            raise taken
        adapter = load_adapter(name, path, self.config, self.max_rank)
        if name in self.adapters:
            raise taken
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> LoRAAdapter:
        """Takes an adapter out: new requests can no longer name it; those running with it finish.

        Raises:
            LoRAError: No adapter has that name.
        """
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
        return adapter

    def get(self, name: str) -> LoRAAdapter | None:
        return self.adapters.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def __iter__(self):
        return iter(list(self.adapters.values()))
