"""Request traces for `pagoda simulate`: synthetic ones, JSONL files and the Azure LLM
inference trace CSV as it is published.

A trace is a list of :class:`TraceRequest` sorted by arrival. The simulator turns each one
into a real :class:`~pagoda.engine.core.request.Request` when it arrives, with prompt token
ids built by :func:`prompt_token_ids` (requests of one prefix group share their leading
tokens, so the prefix cache sees the sharing; other prompts never share a block).
"""

from __future__ import annotations

import csv
import json
import math
import re
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival: When it arrives, in seconds from the trace's start.
        prompt_len: Prompt tokens.
        output_len: Tokens it generates (it never stops earlier).
        prefix_group: Requests of one group share their first ``prefix_len`` prompt tokens.
        prefix_len: Leading prompt tokens shared with the group (0: the whole prompt).
        priority: Scheduling priority (lower runs first under the priority policy).
        client: Who sent it (the fair policy shares service between clients).
        kv_retention: How long its cached blocks are kept (higher: longer) under the
            retention-priority eviction policy.
    """

    arrival: float
    prompt_len: int
    output_len: int
    prefix_group: str | None = None
    prefix_len: int = 0
    priority: int = 0
    client: str | None = None
    kv_retention: int = 0

    def to_json(self) -> dict:
        """The JSONL line's fields (defaults left out)."""
        return {k: v for k, v in asdict(self).items() if v not in (None, 0) or k in _REQUIRED}


_REQUIRED = ("arrival", "prompt_len", "output_len")
_OPTIONAL = {"prefix_group": str, "prefix_len": int, "priority": int, "client": str, "kv_retention": int}


class TraceError(ValueError):
    """A trace file that cannot be read, with the line at fault."""


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Reads a trace: ``.csv`` as the Azure LLM inference trace, anything else as JSONL.

    Args:
        path: The file.
        limit: Keep only the first ``limit`` requests (by arrival).

    Raises:
        TraceError: A line is not valid (the message names the line and the field).
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist")
    with path.open(newline="") as f:
        requests = _read_azure_csv(f, path) if path.suffix.lower() == ".csv" else _read_jsonl(f, path)
    if not requests:
        raise TraceError(f"{path}: the trace holds no request")
    requests.sort(key=lambda r: r.arrival)
    # NOTE: arrivals from the first request on (a trace may hold epoch seconds).
    start = requests[0].arrival
    for request in requests:
        request.arrival -= start
    return requests[:limit] if limit is not None else requests


def _read_jsonl(lines: Iterable[str], path: Path) -> list[TraceRequest]:
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(raw, dict):
            raise TraceError(f"{where}: expected an object per line")
        unknown = set(raw) - set(_REQUIRED) - set(_OPTIONAL)
        if unknown:
            raise TraceError(f"{where}: unknown field(s) {sorted(unknown)}; a line has {list(_REQUIRED)} "
                             f"and optionally {list(_OPTIONAL)}")
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise TraceError(f"{where}: missing {missing}")
        values = {}
        for key, value in raw.items():
            if value is None and key in _OPTIONAL:
                continue  # NOTE: null is absent, as JSON writers (pandas, loggers) write a missing field
            if key == "arrival":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                    and value >= 0
                kind = "a number of seconds >= 0"
            elif key in ("prompt_len", "output_len"):
                ok, kind = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an integer >= 1"
            elif _OPTIONAL[key] is int:
                signed = key in ("priority", "kv_retention")
                ok = isinstance(value, int) and not isinstance(value, bool) and (signed or value >= 0)
                kind = "an integer" if signed else "an integer >= 0"
            else:
                ok, kind = isinstance(value, (str, int)) and not isinstance(value, bool), "a string"
                value = str(value) if ok else value
            if not ok:
                raise TraceError(f"{where}: {key} must be {kind}, got {value!r}")
            values[key] = value
        requests.append(TraceRequest(**values))
    return requests


# "2023-11-16 18:15:46.6805900", with or without the fraction (any number of digits)
# and an optional UTC offset.
_AZURE_TIME = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?$")


def _azure_seconds(text: str) -> float:
    match = _AZURE_TIME.match(text.strip())
    if match is None:
        raise ValueError(text)
    date, clock, fraction, offset = match.groups()
    stamp = datetime.fromisoformat(f"{date}T{clock}").replace(tzinfo=timezone.utc).timestamp()
    if offset and offset != "Z":
        sign = 1 if offset[0] == "+" else -1
        digits = offset[1:].replace(":", "")
        stamp -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return stamp + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


def _read_azure_csv(f, path: Path) -> list[TraceRequest]:
    """The Azure LLM inference trace (2023 and 2024 releases): TIMESTAMP, ContextTokens,
    GeneratedTokens; arrivals are relative to the first request."""
    reader = csv.DictReader(f)
    columns = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    if reader.fieldnames is None or any(c not in reader.fieldnames for c in columns):
        raise TraceError(f"{path}: an Azure trace CSV has the columns {', '.join(columns)}; "
                         f"this one has {reader.fieldnames}")
    rows = []
    for number, row in enumerate(reader, 2):
        if any(row.get(c) is None for c in columns):
            raise TraceError(f"{path}:{number}: expected {len(columns)} columns ({', '.join(columns)})")
        try:
            stamp = _azure_seconds(row["TIMESTAMP"])
        except ValueError:
            raise TraceError(f"{path}:{number}: TIMESTAMP {row['TIMESTAMP']!r} is not a date and time "
                             "(YYYY-MM-DD HH:MM:SS[.fraction])") from None
        try:
            context, generated = int(row["ContextTokens"]), int(row["GeneratedTokens"])
        except ValueError:
            raise TraceError(f"{path}:{number}: ContextTokens and GeneratedTokens must be integers") from None
        if context < 1:
            raise TraceError(f"{path}:{number}: ContextTokens must be >= 1, got {context}")
        # NOTE: the trace has requests that generated nothing; every simulated request
        # generates at least one token (its first token is what TTFT measures).
        rows.append((stamp, context, max(1, generated)))
    if not rows:
        return []
    start = min(stamp for stamp, _, _ in rows)
    return [TraceRequest(stamp - start, context, generated) for stamp, context, generated in rows]


def save_trace(requests: list[TraceRequest], path: str | Path) -> None:
    """Writes a trace as JSONL (what load_trace reads back)."""
    with Path(path).open("w") as f:
        for request in requests:
            f.write(json.dumps(request.to_json()) + "\n")


# -- synthetic traces ----------------------------------------------------------------


def parse_length(spec: str) -> tuple[str, tuple[float, ...]]:
    """A length distribution: ``N`` (fixed), ``A-B`` (uniform integers in [A, B]) or
    ``lognormal:MEDIAN:SIGMA``.

    Raises:
        ValueError: The spec is none of these.
    """
    text = spec.strip()
    try:
        if text.startswith("lognormal:"):
            median, sigma = (float(x) for x in text.split(":")[1:])
            if median >= 1 and sigma >= 0:
                return "lognormal", (median, sigma)
        elif "-" in text:
            low, high = (int(x) for x in text.split("-"))
            if 1 <= low <= high:
                return "uniform", (low, high)
        elif int(text) >= 1:
            return "fixed", (int(text),)
    except ValueError:
        pass
    raise ValueError(f"length {spec!r}: expected N, A-B (1 <= A <= B) or lognormal:MEDIAN:SIGMA")


def _lengths(spec: str, count: int, rng: np.random.Generator, cap: int) -> np.ndarray:
    kind, args = parse_length(spec)
    if kind == "fixed":
        values = np.full(count, args[0])
    elif kind == "uniform":
        values = rng.integers(args[0], args[1] + 1, count)
    else:
        values = np.rint(rng.lognormal(math.log(args[0]), args[1], count))
    return np.clip(values, 1, cap).astype(np.int64)


def synthetic_trace(num_requests: int, rate: float, prompt_len: str = "lognormal:512:1.0",
                    output_len: str = "lognormal:128:1.0", arrival: str = "poisson", burstiness: float = 1.0,
                    prefix_groups: int = 0, prefix_len: int = 0, prefix_fraction: float = 0.0,
                    priorities: int = 1, clients: int = 0, retain_prefixes: bool = False, max_len: int = 32768,
                    seed: int = 0, prefix_zipf: float = 0.0) -> list[TraceRequest]:
    """A synthetic trace.

    Args:
        num_requests: Requests in it.
        rate: Mean arrivals per second (``inf``: all at time 0).
        prompt_len, output_len: Length distributions (see :func:`parse_length`).
        arrival: ``poisson`` (exponential gaps) or ``gamma`` (gaps with coefficient of
            variation ``burstiness``: above 1 burstier than Poisson).
        prefix_groups: Groups of requests that share a prompt prefix (0: none).
        prefix_len: Tokens a group's requests share (their prompts are at least that long).
        prefix_fraction: Fraction of the requests that belong to a group (uniformly).
        priorities: Priorities drawn uniformly from 0 .. priorities - 1.
        clients: Clients drawn uniformly (0: none named).
        retain_prefixes: Grouped requests ask for their blocks to be kept (kv_retention 1).
        max_len: Cap on each length.
        seed: Random seed.
        prefix_zipf: Popularity of the groups: group k (from 0) is drawn with weight
            ``1 / (k + 1) ** prefix_zipf`` (0: uniformly; 1: a few system prompts take most
            requests, a long tail the rest).
    """
    if num_requests < 1:
        raise ValueError("a trace needs at least one request")
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0, got {rate}")
    if arrival not in ("poisson", "gamma"):
        raise ValueError(f"arrival must be poisson or gamma, got {arrival!r}")
    if prefix_groups and prefix_len < 1:
        raise ValueError("prefix groups need --prefix-len >= 1")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if priorities < 1 or clients < 0 or prefix_groups < 0:
        raise ValueError("priorities must be >= 1, clients and prefix groups >= 0")
    if not 0 <= prefix_fraction <= 1:
        raise ValueError(f"the prefix fraction must be in [0, 1], got {prefix_fraction}")
    rng = np.random.default_rng(seed)
    if math.isinf(rate):
        arrivals = np.zeros(num_requests)
    elif arrival == "poisson":
        arrivals = np.cumsum(rng.exponential(1 / rate, num_requests))
    else:
        shape = 1 / burstiness**2
        arrivals = np.cumsum(rng.gamma(shape, 1 / (rate * shape), num_requests))
    prompts = _lengths(prompt_len, num_requests, rng, max_len)
    outputs = _lengths(output_len, num_requests, rng, max_len)
    grouped = rng.random(num_requests) < prefix_fraction if prefix_groups else np.zeros(num_requests, bool)
    if prefix_zipf > 0 and prefix_groups:
        weights = 1 / np.arange(1, prefix_groups + 1) ** prefix_zipf
        groups = rng.choice(prefix_groups, num_requests, p=weights / weights.sum())
    else:
        groups = rng.integers(0, max(prefix_groups, 1), num_requests)
    levels = rng.integers(0, priorities, num_requests)
    who = rng.integers(0, max(clients, 1), num_requests)
    trace = []
    for i in range(num_requests):
        request = TraceRequest(float(arrivals[i]), int(prompts[i]), int(outputs[i]), priority=int(levels[i]),
                               client=f"client-{who[i]}" if clients else None)
        if grouped[i]:
            request.prefix_group, request.prefix_len = f"group-{groups[i]}", prefix_len
            request.kv_retention = int(retain_prefixes)
            request.prompt_len = max(request.prompt_len, prefix_len + 1)
        trace.append(request)
    return trace


def prompt_token_ids(request: TraceRequest, index: int, vocab_size: int) -> list[int]:
    """The prompt the simulator (and the fidelity check's real engine) runs for a request.

    Ids are below ``vocab_size``. A grouped request starts with token 0 and its group's two
    marker tokens, then filler, for its ``prefix_len`` tokens (its whole prompt when 0); its
    own part, like an ungrouped prompt, starts with two tokens from its index (unique up
    to (vocab_size - 1)**2 requests), so no other prompt shares its blocks.
    """
    mod = vocab_size - 1
    own = [1 + index % mod, 1 + (index // mod) % mod]
    if request.prefix_group is None:
        return own[:request.prompt_len] + [3] * (request.prompt_len - 2)
    shared = request.prompt_len if request.prefix_len == 0 else min(request.prefix_len, request.prompt_len)
    key = _group_number(request.prefix_group)
    prefix = ([0, 1 + key % mod, 1 + (key // mod) % mod] + [4] * shared)[:shared]
    rest = request.prompt_len - shared
    return prefix + (own + [3] * rest)[:rest]


def _group_number(group: str) -> int:
    """A stable number for a group name (the same in every process)."""
    return zlib.crc32(group.encode())
