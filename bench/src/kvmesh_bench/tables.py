"""What every benchmark outputs: a plain-text result table (right-aligned columns, a rule under the
header) and, with ``--json PATH``, its figures as JSON."""

from __future__ import annotations

import json
import math
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
    """Indented JSON with a final newline; missing parent folders are created.

    A figure that is no number (NaN, an infinity: a percentile of nothing) is written as null: JSON has
    no NaN, and Python's ``NaN`` token made the file unreadable to strict parsers (jq, JavaScript).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_finite(payload, default), indent=2, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")


def _finite(value: Any, default: Callable[[Any], Any] | None) -> Any:
    """``value`` with every non-finite float replaced by None (``default`` first turns what JSON cannot)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: _finite(item, default) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item, default) for item in value]
    if value is None or isinstance(value, str | int | bool):
        return value
    if default is None:
        return value  # json.dumps says what it cannot write
    return _finite(default(value), default)
