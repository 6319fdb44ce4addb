"""Step-time models for `pagoda simulate`: how long the worker would take for one step.

A step is described by its :class:`StepShape` (tokens run, requests, rows sampled, query-key
pairs of attention, K/V tokens read, blocks swapped), taken from the scheduler's output and
the requests' state at the moment the step is sent, the same way for the simulator and for
the real engine (``pagoda bench step-time`` records real steps with it).

Two models:
- :class:`Roofline`: named devices (H100, H200, A100, L4) from their datasheet peak rates
  and the model's FLOPs and bytes per step, with efficiency factors.
- :class:`FittedProfile`: a linear model in the shape's terms, fitted (non-negative least
  squares) to real steps of the real engine on the machine at hand by
  ``pagoda bench step-time``, saved as JSON and read back with ``--device FILE``.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pagoda.engine.model_config import ModelConfig
from pagoda.engine.messages import SchedulerOutput

#: The terms of a step's cost, in the order of FittedProfile's coefficients.
TERMS = ("step", "token", "request", "sampled", "attention_pair", "kv_token", "swapped_block")


@dataclass(slots=True)
class StepShape:
    """What one step computes.

    Attributes:
        num_tokens: Query tokens run (prefill chunks and decodes).
        num_requests: Requests in the step.
        num_sampled: Rows whose logits are computed (requests that reach the end of
            their known tokens).
        attention_pairs: Query-key pairs attention scores (causal within the new tokens).
        kv_tokens: K/V tokens read: each request's context up to the step's end.
        swapped_blocks: Blocks swapped in or out before the step.
    """

    num_tokens: int = 0
    num_requests: int = 0
    num_sampled: int = 0
    attention_pairs: int = 0
    kv_tokens: int = 0
    swapped_blocks: int = 0

    def terms(self) -> list[float]:
        """The shape as FittedProfile's terms (TERMS)."""
        return [1.0, self.num_tokens, self.num_requests, self.num_sampled, self.attention_pairs,
                self.kv_tokens, self.swapped_blocks]


def step_shape(scheduler_output: SchedulerOutput, requests: Mapping) -> tuple[StepShape, list[str]]:
    """The shape of a step just scheduled, and the requests it samples for.

    Call it right after ``schedule()``: a request's ``num_computed_tokens`` then counts this
    step's tokens, so it is where the step ends.

    Args:
        scheduler_output: The step.
        requests: The scheduler's requests by id.
    """
    shape = StepShape(swapped_blocks=len(scheduler_output.swap_in) + len(scheduler_output.swap_out))
    sampled = []
    pairs = kv = 0
    for request_id, num in scheduler_output.num_scheduled_tokens.items():
        request = requests[request_id]
        end = request.num_computed_tokens
        pairs += num * (end - num) + num * (num + 1) // 2
        kv += end
        # NOTE: the scheduler's rule (Scheduler._commit): a step that reaches the end of the
        # known tokens and those in flight samples one more, which is now pending.
        pending = request.num_pending_tokens
        if pending and end == request.num_tokens + pending - 1:
            sampled.append(request_id)
    shape.num_tokens = scheduler_output.total_num_scheduled_tokens
    shape.num_requests = len(scheduler_output.num_scheduled_tokens)
    shape.num_sampled = len(sampled)
    shape.attention_pairs = pairs
    shape.kv_tokens = kv
    return shape, sampled


class StepTimeModel:
    """Seconds of one step from its shape."""

    #: Engine time between a step's result and the next step (sync scheduling).
    engine_overhead_s: float = 0.0

    def step_seconds(self, shape: StepShape) -> float:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


# -- the roofline ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A device's peak rates (dense bf16/fp16 tensor FLOPs, memory bandwidth) and what a
    step reaches of them.

    Attributes:
        name: Its name.
        flops: Peak dense 16-bit FLOP/s.
        bandwidth: Memory bandwidth, bytes/s.
        memory_bytes: Device memory.
        link_bandwidth: Bytes/s one way between two devices (NVLink, or PCIe).
        link_latency_s: Latency of one all-reduce.
        host_bandwidth: Bytes/s to host memory (swap).
        matmul_efficiency: Fraction of ``flops`` large matrix products reach.
        attention_efficiency: Fraction of ``flops`` attention reaches.
        bandwidth_efficiency: Fraction of ``bandwidth`` streaming reads reach.
        step_overhead_s: Fixed time per step (launches, sampling, the host).
    """

    name: str
    flops: float
    bandwidth: float
    memory_bytes: float
    link_bandwidth: float
    link_latency_s: float = 10e-6
    host_bandwidth: float = 25e9
    matmul_efficiency: float = 0.55
    attention_efficiency: float = 0.35
    bandwidth_efficiency: float = 0.75
    step_overhead_s: float = 0.002


_GB = 1e9
#: Datasheet figures (SXM parts; L4 without NVLink, its link is PCIe 4.0 x16).
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("H100 SXM 80GB", 989e12, 3.35e12, 80 * _GB, 450 * _GB, host_bandwidth=55 * _GB),
    "h200": DeviceSpec("H200 SXM 141GB", 989e12, 4.8e12, 141 * _GB, 450 * _GB, host_bandwidth=55 * _GB),
    "a100": DeviceSpec("A100 SXM 80GB", 312e12, 2.039e12, 80 * _GB, 300 * _GB),
    "l4": DeviceSpec("L4 24GB", 121e12, 300e9, 24 * _GB, 32 * _GB, link_latency_s=30e-6),
}


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """A model's sizes (whole model; Roofline divides them over tensor-parallel ranks)."""

    linear_params: int  # every decoder layer's weights (projections and MLP)
    head_params: int  # the LM head
    embedding_params: int  # the input embedding when not tied to the head (stored, barely read)
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    hidden: int

    @classmethod
    def of(cls, model: ModelConfig) -> ModelCosts:
        q = model.num_attention_heads * model.head_dim
        kv = model.num_key_value_heads * model.head_dim
        hidden = model.hidden_size
        per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * model.intermediate_size
        table = hidden * model.vocab_size
        return cls(per_layer * model.num_hidden_layers, table, 0 if model.tie_word_embeddings else table,
                   model.num_attention_heads, model.num_key_value_heads, model.head_dim, model.num_hidden_layers,
                   hidden)

    @property
    def num_params(self) -> int:
        return self.linear_params + self.head_params


class Roofline(StepTimeModel):
    """A step's time from FLOPs and bytes: the linear layers take the longer of their
    FLOPs at ``matmul_efficiency`` and their weights' bytes at ``bandwidth_efficiency``;
    attention the longer of its FLOPs and its K/V bytes; plus the all-reduces of tensor
    parallelism (two per layer), swaps, and a fixed overhead.

    Args:
        device: The device.
        model: The model's shape.
        dtype_bytes: Bytes of a weight (2 for bf16).
        kv_dtype_bytes: Bytes of a K/V element.
        tensor_parallel_size: Ranks the model is split over (each a device).
    """

    def __init__(self, device: DeviceSpec, model: ModelConfig, dtype_bytes: int = 2, kv_dtype_bytes: int = 2,
                 tensor_parallel_size: int = 1) -> None:
        self.device = device
        self.costs = c = ModelCosts.of(model)
        self.dtype_bytes = dtype_bytes
        self.tp = tensor_parallel_size
        # NOTE: KV heads split over the ranks, or copied to each when there are fewer.
        self.kv_bytes_per_token = 2 * c.layers * -(-c.kv_heads // tensor_parallel_size) * c.head_dim * kv_dtype_bytes
        self._block_swap_s = 0.0

    @property
    def weight_bytes(self) -> float:
        """Weights each rank reads in a step (all but the input embedding's table)."""
        return self.costs.num_params * self.dtype_bytes / self.tp

    @property
    def weight_memory_bytes(self) -> float:
        """Weights each rank stores."""
        return (self.costs.num_params + self.costs.embedding_params) * self.dtype_bytes / self.tp

    def step_seconds(self, shape: StepShape) -> float:
        d, c, tp = self.device, self.costs, self.tp
        matmul_rate, attention_rate = d.flops * d.matmul_efficiency, d.flops * d.attention_efficiency
        read_rate = d.bandwidth * d.bandwidth_efficiency
        linear = max(2 * (shape.num_tokens * c.linear_params + shape.num_sampled * c.head_params) / tp / matmul_rate,
                     self.weight_bytes / read_rate) if shape.num_tokens else 0.0
        attention = max(4 * shape.attention_pairs * c.heads * c.head_dim * c.layers / tp / attention_rate,
                        (shape.kv_tokens + shape.num_tokens) * self.kv_bytes_per_token / read_rate)
        comm = 0.0
        if tp > 1 and shape.num_tokens:
            volume = shape.num_tokens * c.hidden * self.dtype_bytes * 2 * (tp - 1) / tp
            comm = 2 * c.layers * (d.link_latency_s + volume / d.link_bandwidth)
        return d.step_overhead_s + linear + attention + comm + shape.swapped_blocks * self._block_swap_s

    def with_block_size(self, block_size: int) -> Roofline:
        """Sets the time to swap one block (its K/V over the host link)."""
        self._block_swap_s = block_size * self.kv_bytes_per_token / self.device.host_bandwidth
        return self

    def kv_cache_bytes(self, memory_utilization: float, reserve_bytes: float = 2 * _GB) -> int:
        """KV cache bytes per rank: the device's memory times ``memory_utilization``, less
        the weights and a reserve for activations (vLLM's --gpu-memory-utilization)."""
        free = self.device.memory_bytes * memory_utilization - self.weight_memory_bytes - reserve_bytes
        if free <= 0:
            raise ValueError(f"the model's weights ({self.weight_memory_bytes / _GB:.1f} GB per device) do not fit in "
                             f"{memory_utilization:.0%} of a {self.device.name} with {reserve_bytes / _GB:.0f} GB "
                             "left for activations; raise --tensor-parallel-size")
        return int(free)

    def describe(self) -> str:
        d = self.device
        return (f"roofline {d.name}: {d.flops / 1e12:.3g} TFLOP/s x {d.matmul_efficiency}, "
                f"{d.bandwidth / 1e12:.3g} TB/s x {d.bandwidth_efficiency}, {d.step_overhead_s * 1e3:.1f} ms a step"
                + (f", TP {self.tp}" if self.tp > 1 else ""))


# -- the fitted profile ---------------------------------------------------------------


@dataclass(slots=True)
class FittedProfile(StepTimeModel):
    """A linear model of step time, fitted to real steps of the real engine.

    Attributes:
        coefficients: Seconds per unit of each term of TERMS.
        engine_overhead_s: Mean engine time between a step's result and the next step,
            as measured (the worker's idle time per step under sync scheduling).
        device: What it was measured on (the CPU's name).
        model: The model's shape it was measured with (layers, hidden size, heads...).
        dtype: The dtype the engine ran.
        kv_dtype_bytes: Bytes of a K/V element in the measured engine.
        fit: How well it fits (steps, mean absolute error in %, held-out).
    """

    coefficients: dict[str, float]
    engine_overhead_s: float = 0.0
    device: str = "this machine"
    model: dict = field(default_factory=dict)
    dtype: str = "bfloat16"
    kv_dtype_bytes: int = 2
    fit: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(TERMS)
        if unknown:
            raise ValueError(f"unknown step-time terms {sorted(unknown)}; the terms are {list(TERMS)}")
        self._vector = np.array([float(self.coefficients.get(term, 0.0)) for term in TERMS])

    def step_seconds(self, shape: StepShape) -> float:
        return float(self._vector @ np.array(shape.terms()))

    def describe(self) -> str:
        terms = ", ".join(f"{k} {v * 1e6:.3g} us" for k, v in self.coefficients.items() if v)
        return f"fitted profile of {self.device}: {terms}"

    def save(self, path: str | Path) -> None:
        data = asdict(self)
        data["kind"] = "fitted"
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> FittedProfile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the step-time profile {path}: {exc}") from None
        if not isinstance(data, dict) or data.pop("kind", None) != "fitted" or "coefficients" not in data:
            raise ValueError(f"{path} is not a step-time profile (write one with `pagoda bench step-time`)")
        return cls(**data)

    def check_model(self, model: ModelConfig) -> None:
        """Raises ValueError when the profile was measured on another model's shape."""
        measured = self.model
        mine = model_summary(model)
        if measured and measured != mine:
            raise ValueError(f"the profile was measured with a model of shape {measured}, not {mine}: "
                             "measure one for this model (`pagoda bench step-time --model ...`)")


def model_summary(model: ModelConfig) -> dict:
    """The shape terms a fitted profile depends on."""
    return {"layers": model.num_hidden_layers, "hidden": model.hidden_size, "intermediate": model.intermediate_size,
            "heads": model.num_attention_heads, "kv_heads": model.num_key_value_heads, "head_dim": model.head_dim,
            "vocab": model.vocab_size}


def fit_profile(shapes: Sequence[StepShape], seconds: Sequence[float]) -> tuple[dict[str, float], float]:
    """Non-negative least squares (Lawson-Hanson) of step seconds on the shapes' terms,
    relative to each step's time (so that short decode steps count as much as long
    prefills).

    Returns:
        The coefficients by term (terms no step exercises are 0), and the mean absolute
        relative error over the given steps, in %.
    """
    x = np.array([shape.terms() for shape in shapes], dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if len(y) < len(TERMS):
        raise ValueError(f"fitting needs at least {len(TERMS)} steps, got {len(y)}")
    weights = 1 / np.maximum(y, 1e-6)
    used = [i for i in range(len(TERMS)) if np.any(x[:, i])]
    scale = np.maximum(np.abs(x[:, used]).max(axis=0), 1e-30)
    coef = np.zeros(len(TERMS))
    coef[used] = _nnls(x[:, used] / scale * weights[:, None], y * weights) / scale
    error = float(np.mean(np.abs(x @ coef - y) / np.maximum(y, 1e-9)) * 100)
    return dict(zip(TERMS, coef.tolist())), error


def probe_cpu(seconds: float = 0.5) -> DeviceSpec:
    """A roofline device for this CPU from two quick measurements with numpy: the rate of a
    float32 matrix product (BLAS, every core) and of a large copy (memory bandwidth). They
    are rates reached, not peaks, so the efficiencies are 1; ``pagoda bench step-time``
    measures how far this first-principles estimate is from the engine's real steps."""
    def rate(work: float, run) -> float:
        run()  # warm-up
        best, deadline = 0.0, time.perf_counter() + seconds / 2
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            run()
            best = max(best, work / (time.perf_counter() - start))
        return best

    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    flops = rate(2 * n**3, lambda: a @ a)
    source = np.ones(64 * 1024 * 1024 // 8)  # 64 MiB: well past the caches
    target = np.empty_like(source)
    bandwidth = rate(2 * source.nbytes, lambda: np.copyto(target, source))
    name = cpu_model_name()
    return DeviceSpec(f"{name} ({os.cpu_count()} cores, measured)", flops, bandwidth, memory_bytes=0.0,
                      link_bandwidth=bandwidth, host_bandwidth=bandwidth, matmul_efficiency=1.0,
                      attention_efficiency=1.0, bandwidth_efficiency=1.0, step_overhead_s=1e-3)


def cpu_model_name() -> str:
    """This CPU's model name (``/proc/cpuinfo``), or the platform's processor."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nnls(a: np.ndarray, b: np.ndarray, iterations: int = 100) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iterations):
        gradient = a.T @ (b - a @ x)
        free = ~passive & (gradient > 1e-12 * max(1.0, np.abs(gradient).max()))
        if not free.any():
            break
        passive[np.argmax(np.where(free, gradient, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            # step back to the boundary, and drop the terms that reach 0
            blocked = passive & (z <= 0)
            alpha = np.min(x[blocked] / np.maximum(x[blocked] - z[blocked], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


def load_step_time(device: str, model: ModelConfig, block_size: int, dtype_bytes: int = 2, kv_dtype_bytes: int = 2,
                   tensor_parallel_size: int = 1) -> StepTimeModel:
    """The model ``--device`` names: h100, h200, a100, l4, cpu (this CPU, probed), or a
    profile file.

    Raises:
        ValueError: An unknown name, an unreadable file, or a profile of another model.
    """
    name = device.lower()
    if name in DEVICES or name == "cpu":
        spec = probe_cpu() if name == "cpu" else DEVICES[name]
        return Roofline(spec, model, dtype_bytes, kv_dtype_bytes, tensor_parallel_size).with_block_size(block_size)
    path = Path(device)
    if not path.is_file():
        raise ValueError(f"unknown device {device!r}: expected one of {sorted([*DEVICES, 'cpu'])} or a profile file from "
                         "`pagoda bench step-time`")
    profile = FittedProfile.load(path)
    profile.check_model(model)
    if tensor_parallel_size != 1:
        raise ValueError("a measured profile is of one engine as measured; simulate tensor parallelism on a named "
                         "device")
    return profile


def percent_error(predicted: Sequence[float], measured: Sequence[float]) -> dict:
    """Step-time errors: the mean and median absolute relative error, and the error of the
    total, in %."""
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    rel = np.abs(p - m) / np.maximum(m, 1e-9) * 100
    total = (p.sum() - m.sum()) / max(m.sum(), 1e-9) * 100
    return {"steps": int(len(m)), "mean_abs_error_pct": round(float(rel.mean()), 2),
            "median_abs_error_pct": round(float(np.median(rel)), 2), "total_error_pct": round(float(total), 2)}
