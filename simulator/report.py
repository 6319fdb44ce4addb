"""What `pagoda simulate` reports: latency percentiles, goodput under SLOs, KV usage and
queues over time, preemptions, prefix hits; a table across policies; PNG plots."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagoda.simulator.simulator import SimulationResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets a request must meet to count toward goodput (None: no target)."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """``ttft=2,tpot=0.1`` (seconds; ``ms`` suffix allowed: ``tpot=100ms``)."""
        if not text:
            return cls()
        values = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            key = key.strip().lower()
            if key not in ("ttft", "tpot", "e2e") or not value:
                raise ValueError(f"--slo {text!r}: expected ttft=S,tpot=S,e2e=S (any of them)")
            value = value.strip()
            try:
                seconds = float(value[:-2]) / 1000 if value.endswith("ms") else float(value.rstrip("s"))
            except ValueError:
                raise ValueError(f"--slo {key}={value!r}: not a number of seconds") from None
            if not seconds > 0:
                raise ValueError(f"--slo {key} must be > 0")
            values[key] = seconds
        return cls(**values)

    def __str__(self) -> str:
        parts = [f"{k}<={v * 1000:g}ms" for k, v in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e))
                 if v is not None]
        return ", ".join(parts) or "none"


def _percentiles(values: np.ndarray) -> dict:
    if len(values) == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    return {"mean": float(values.mean()), **{f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}}


def latencies(result: SimulationResult) -> dict[str, np.ndarray]:
    """Per finished request: TTFT, TPOT (mean gap after the first token; requests with
    one token have none) and E2E, in seconds."""
    done = ~np.isnan(result.finish)
    ttft = result.first_token[done] - result.arrival[done]
    e2e = result.finish[done] - result.arrival[done]
    gaps = result.num_output[done] - 1
    decode = gaps > 0
    tpot = (result.finish[done][decode] - result.first_token[done][decode]) / gaps[decode]
    tpot_all = np.full(done.sum(), np.nan)
    tpot_all[decode] = tpot
    return {"ttft": ttft, "tpot": tpot_all, "e2e": e2e}


def summarize(result: SimulationResult, slo: SLO) -> dict:
    """The numbers of one run (JSON-ready)."""
    lat = latencies(result)
    done = ~np.isnan(result.finish)
    start = float(result.arrival.min()) if len(result.arrival) else 0.0
    end = float(np.nanmax(result.finish)) if done.any() else start
    duration = max(end - start, 1e-9)
    good = np.ones(done.sum(), dtype=bool)
    for name in ("ttft", "tpot", "e2e"):
        limit = getattr(slo, name)
        if limit is not None:
            good &= ~(lat[name] > limit)  # NOTE: a request without a TPOT meets any TPOT target
    output_tokens = int(result.num_output.sum())
    usage = result.series_kv_usage
    return {
        "scheduling_policy": result.policy,
        "eviction_policy": result.eviction,
        "requests": int(len(result.arrival)),
        "finished": int(done.sum()),
        "rejected_too_long": int(result.rejected.sum()),
        "duration_s": duration,
        "requests_per_s": float(done.sum() / duration),
        "output_tokens_per_s": output_tokens / duration,
        "ttft_s": _percentiles(lat["ttft"]),
        "tpot_s": _percentiles(lat["tpot"][~np.isnan(lat["tpot"])]),
        "itl_s": _percentiles(result.itl),
        "e2e_s": _percentiles(lat["e2e"]),
        "slo": str(slo),
        "goodput_requests_per_s": float(good.sum() / duration),
        # NOTE: a request rejected as too long missed its targets too.
        "slo_attainment": float(good.sum() / (len(good) + result.rejected.sum())) if len(result.arrival) else None,
        "preemptions": result.num_preemptions,
        "swapped_out": result.num_swapped_out,
        "recomputed": result.num_recomputed,
        "prefix_cache_hit_rate": result.prompt_tokens_cached / result.prompt_tokens if result.prompt_tokens else 0.0,
        "disk_tier_hit_rate": result.prompt_tokens_loaded / result.prompt_tokens if result.prompt_tokens else 0.0,
        "disk_tier_gib": result.disk_tier_gib,
        "kv_usage_mean": float(usage.mean()) if len(usage) else 0.0,
        "kv_usage_max": float(usage.max()) if len(usage) else 0.0,
        "queue_mean": float(result.series_waiting.mean()) if len(usage) else 0.0,
        "queue_max": int(result.series_waiting.max()) if len(usage) else 0,
        "max_running": result.max_running,
        "kv_blocks": result.num_blocks,
        "steps": result.num_steps,
        "device_busy_fraction": result.busy_seconds / duration,
        "wall_s": result.wall_seconds,
        "simulated_requests_per_wall_s": float(len(result.arrival) / max(result.wall_seconds, 1e-9)),
        "simulated_steps_per_wall_s": float(result.num_steps / max(result.wall_seconds, 1e-9)),
        "by_priority": by_priority(result),
    }


def time_series(result: SimulationResult, points: int = 1000) -> dict:
    """KV usage, running and waiting requests over time: means over ``points`` equal windows
    of simulated time (empty windows left out)."""
    t = result.series_time
    if len(t) == 0:
        return {"time_s": [], "kv_usage": [], "running": [], "waiting": []}
    span = max(t[-1] - t[0], 1e-9)
    window = np.minimum(((t - t[0]) / span * points).astype(np.int64), points - 1)
    counts = np.bincount(window, minlength=points)
    used = counts > 0

    def mean(values: np.ndarray) -> np.ndarray:
        return np.bincount(window, weights=values, minlength=points)[used] / counts[used]

    centers = t[0] + (np.arange(points)[used] + 0.5) * span / points
    return {"time_s": centers.round(3).tolist(), "kv_usage": mean(result.series_kv_usage).round(4).tolist(),
            "running": mean(result.series_running).round(1).tolist(),
            "waiting": mean(result.series_waiting).round(1).tolist()}


def by_priority(result: SimulationResult) -> dict:
    """TTFT and E2E percentiles per priority level (when the trace has several)."""
    levels = np.unique(result.priority)
    if len(levels) < 2:
        return {}
    lat = latencies(result)
    done_priority = result.priority[~np.isnan(result.finish)]
    return {str(int(level)): {"finished": int((done_priority == level).sum()),
                              "ttft_s": _percentiles(lat["ttft"][done_priority == level]),
                              "e2e_s": _percentiles(lat["e2e"][done_priority == level])} for level in levels}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def table(summaries: list[dict]) -> str:
    """A markdown table comparing runs (one row each)."""
    head = ("| scheduling | eviction | TTFT p50 / p99 ms | TPOT p50 / p99 ms | E2E p50 / p99 s | goodput req/s "
            "| SLO met | out tok/s | preempt | prefix hits | KV mean / max | queue max | rejected |")
    rule = "|" + "---|" * 2 + "---:|" * 11
    rows = [head, rule]
    for s in summaries:
        ttft, tpot, e2e = s["ttft_s"], s["tpot_s"], s["e2e_s"]
        attained = "-" if s["slo_attainment"] is None else f"{s['slo_attainment']:.1%}"
        rows.append(
            f"| {s['scheduling_policy']} | {s['eviction_policy']}{_tier(s)} | {_ms(ttft['p50'])} / {_ms(ttft['p99'])} "
            f"| {_ms(tpot['p50'])} / {_ms(tpot['p99'])} | {e2e['p50'] or 0:,.1f} / {e2e['p99'] or 0:,.1f} "
            f"| {s['goodput_requests_per_s']:,.2f} | {attained} | {s['output_tokens_per_s']:,.0f} "
            f"| {s['preemptions']:,} | {s['prefix_cache_hit_rate']:.1%} "
            f"| {s['kv_usage_mean']:.0%} / {s['kv_usage_max']:.0%} | {s['queue_max']:,} "
            f"| {s['rejected_too_long']:,} |")
    return "\n".join(rows)


def _tier(summary: dict) -> str:
    """The eviction cell's note of a disk tier: its size and the share of prompt tokens it served."""
    if not summary.get("disk_tier_gib"):
        return ""
    return f", disk {summary['disk_tier_gib']:g} GiB ({summary['disk_tier_hit_rate']:.0%} read back)"


def plot(results: list[SimulationResult], directory: str | Path, title: str) -> list[Path]:
    """Latency CDFs (TTFT, TPOT, E2E) and KV usage / queue length over time, one line per
    run; returns the PNG files written.

    Raises:
        RuntimeError: matplotlib is not installed (the `plot` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'pagoda[plot]' (or pip install matplotlib)") from None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    label = [f"{r.policy} / {r.eviction}" for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for result, name in zip(results, label):
        lat = latencies(result)
        for ax, key in zip(axes, ("ttft", "tpot", "e2e")):
            values = np.sort(lat[key][~np.isnan(lat[key])])
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=name)
    for ax, key in zip(axes, ("TTFT", "TPOT", "E2E latency")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{key} (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{title}: latency CDFs")
    fig.tight_layout()
    cdf = directory / "latency_cdf.png"
    fig.savefig(cdf, dpi=110)
    plt.close(fig)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 6.5), sharex=True)
    for result, name in zip(results, label):
        series = time_series(result, points=400)
        top.plot(series["time_s"], series["kv_usage"], label=name, linewidth=0.9)
        bottom.plot(series["time_s"], series["waiting"], label=name, linewidth=0.9)
    top.set_ylabel("KV cache in use\n(window means)")
    top.set_ylim(0, 1.02)
    bottom.set_ylabel("requests waiting\n(window means)")
    bottom.set_xlabel("simulated time (s)")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.suptitle(f"{title}: KV usage and queue over time")
    fig.tight_layout()
    usage = directory / "kv_usage.png"
    fig.savefig(usage, dpi=110)
    plt.close(fig)
    return [cdf, usage]
