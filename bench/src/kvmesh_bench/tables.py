"""The plain-text result table every benchmark prints (right-aligned columns, a rule under the header)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Column = tuple[str, str, str]  # (key in the row, title, format spec)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    table = [[title for _, title, _ in columns]]
    table += [[fmt.format(row[key]) for key, _, fmt in columns] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
