"""What every benchmark outputs: a plain-text result table (right-aligned columns, a rule under the
header) and, with ``--json PATH``, its figures as JSON."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

Column = tuple[str, str, str]  # (key in the row, title, format spec)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    table = [[title for _, title, _ in columns]]
    table += [[fmt.format(row[key]) for key, _, fmt in columns] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | Path, payload: Any, default: Callable[[Any], Any] | None = None) -> None:
    """Indented JSON with a final newline; missing parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=default) + "\n", encoding="utf-8")
