"""What a `pagoda bench` command prints while it runs, and the table at its end.

Each run (a workload's run, a policy, a batch size) prints one readable line as it finishes,
so that a long benchmark is never silent; ``--json`` prints each run's record as a JSON line
instead, for scripts. The table at the end is printed either way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence


def add_json_flag(parser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print each run's record as a JSON line instead of a readable line")


def emit(args, record: dict, line: str) -> None:
    """Prints one run: ``line``, or ``record`` as JSON under --json."""
    print(json.dumps(record) if getattr(args, "json", False) else line, flush=True)


def note(args, line: str) -> None:
    """A readable line about what runs next (starting an engine, a warm-up); none under --json."""
    if not getattr(args, "json", False):
        print(line, flush=True)


def table(records: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """Records as a table: ``columns`` are (header, key, format spec); each column as wide as
    its widest cell, right-aligned but for the first."""
    cells = [[header for header, _, _ in columns]]
    cells += [[format(r[key], spec) if r.get(key) is not None else "-" for _, key, spec in columns] for r in records]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                     for row in cells)
