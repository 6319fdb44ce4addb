"""What does not run with what: one table, checked when an EngineConfig is built.

Each entry is a pair of settings the engine does not run together. A *refused* pair is an
error at once, when the configuration is built (before any model is loaded), naming both
settings and the way out. A pair with a *fallback* runs, one of the two done another way; which
applies depends on what the start resolves (whether the weights are quantized, whether the
device is a GPU), so the code that resolves it logs the fallback at start, and the entry here
documents it. docs/engine.md's table "What runs with what" is :func:`markdown_table` (a test
holds the two together).

Rules that depend on the machine or the model rather than on the settings (a CPU without
AVX512-BF16 for --batch-invariant, a model's mixture-of-experts layers and CUDA graphs, an
attention backend that cannot run a model's heads) are checked where those are known, at start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.engine.config import EngineConfig


@dataclass(frozen=True)
class Incompatibility:
    """Two settings that do not run together.

    Attributes:
        setting: The first setting, as a user names it (a flag).
        other: The one it does not run with.
        outcome: For a refused pair, what to do instead; for a fallback, what runs.
        refuses: For a refused pair, whether a configuration sets both; None for a fallback
            (it runs, and the start-up log says how).
    """

    setting: str
    other: str
    outcome: str
    refuses: Callable[[EngineConfig], bool] | None = None


def _draft_model(config: EngineConfig) -> bool:
    return config.speculative_config is not None and config.speculative_config.method == "draft_model"


def _parallel(config: EngineConfig) -> bool:
    return config.tensor_parallel_size > 1


INCOMPATIBILITIES: tuple[Incompatibility, ...] = (
    Incompatibility("--speculative-config with a draft model", "--tensor-parallel-size above 1",
                    "use the 'ngram' method, which drafts without a model, or one rank",
                    lambda c: _draft_model(c) and _parallel(c)),
    Incompatibility("--quantization int8", "--tensor-parallel-size above 1",
                    "pass --quantization none (bfloat16 weights, sharded), or run on one rank",
                    lambda c: c.quantization == "int8" and _parallel(c)),
    Incompatibility("--batch-invariant", "an --attention-backend other than cpu_paged",
                    "leave --attention-backend auto (cpu_paged computes each query row alone, in fixed partitions)",
                    lambda c: c.batch_invariant and c.attention_backend not in ("auto", "cpu_paged")),
    Incompatibility("a GGUF file's or a checkpoint's quantized weights (--quantization auto)",
                    "--tensor-parallel-size above 1",
                    "the weights are dequantized at load to the model's dtype, then sharded"),
    Incompatibility("--enable-lora", "--batch-invariant",
                    "the adapters' deltas are summed per adapter group, whose size depends on the batch; leave one "
                    "of them off", lambda c: c.enable_lora and c.batch_invariant),
    Incompatibility("--enable-lora", "CUDA graphs, the one-call CPU forward, compiled regions",
                    "a step with adapter rows runs the model layer by layer, eagerly; steps of the base model alone "
                    "run as before"),
    Incompatibility("--kv-offload-dir, --kv-offload-host-gib", "--tensor-parallel-size above 1, a draft model, Ray workers",
                    "each rank (and the draft) would keep its own share of a block, and a Ray actor has no time "
                    "between steps to write in; run the tier on one local rank without a draft model",
                    lambda c: c.offloads_kv and (
                        _parallel(c) or _draft_model(c) or c.distributed_executor_backend == "ray")),
    Incompatibility("CUDA graphs", "--tensor-parallel-size above 1, a draft model, mixture-of-experts layers",
                    "decode steps run eagerly on the GPU; the start-up line names the reason"),
)


def check(config: EngineConfig) -> None:
    """Raises ValueError for the first refused pair that ``config`` sets, with the way out."""
    for entry in INCOMPATIBILITIES:
        if entry.refuses is not None and entry.refuses(config):
            raise ValueError(f"{entry.setting} does not run with {entry.other} yet: {entry.outcome}")


def markdown_table() -> str:
    """docs/engine.md's table "What runs with what"."""
    rows = ["| setting | does not run with | what happens |", "|---|---|---|"]
    rows += [f"| {e.setting} | {e.other} | {'refused: ' if e.refuses else 'runs: '}{e.outcome} |"
             for e in INCOMPATIBILITIES]
    return "\n".join(rows)
