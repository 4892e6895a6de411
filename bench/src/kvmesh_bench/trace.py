"""The Mooncake JSONL trace format: the one reader and writer every kvmesh tool uses.

One JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

- ``timestamp``: arrival time in milliseconds since the first request (several requests may share one).
- ``input_length`` / ``output_length``: prompt and completion lengths in tokens.
- ``hash_ids``: one id per KV block of the prompt (Mooncake uses 512-token blocks). Requests that share a
  leading run of ids share that prefix's KV cache. In the published traces
  ``len(hash_ids) == ceil(input_length / block_size)``; the reader does not enforce it (other block sizes
  and hand-made traces are allowed).

Any other field (``session_id``, ``delay``, ...) is kept: ``session_id`` on its own attribute, the rest in
``extra``, and both are written back by :func:`write_trace`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "TraceError",
    "TraceRequest",
    "load_trace",
    "parse_row",
    "write_trace",
]

#: Block size (tokens per hash id) of the published Mooncake traces.
DEFAULT_BLOCK_SIZE = 512

_REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace file cannot be read: names the file, the line (when there is one) and the reason."""

    def __init__(self, path: str | Path, reason: str, line: int | None = None) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def to_json_dict(self) -> dict[str, Any]:
        """The row as written to JSONL: the four Mooncake fields first, then ``session_id`` and ``extra``."""
        row: dict[str, Any] = {
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.session_id is not None:
            row["session_id"] = self.session_id
        for key, value in self.extra.items():
            if key not in row:
                row[key] = value
        return row


def _describe(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _non_negative_int(row: Mapping[str, Any], key: str) -> int:
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"field '{key}' must be a non-negative integer, got {_describe(value)}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"field '{key}' must be a non-negative integer, got {_describe(value)}")
        value = int(value)
    if value < 0:
        raise ValueError(f"field '{key}' must be a non-negative integer, got {value}")
    return value


def _timestamp(row: Mapping[str, Any]) -> float:
    value = row["timestamp"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"field 'timestamp' must be a non-negative number (ms), got {_describe(value)}")
    if value < 0:
        raise ValueError(f"field 'timestamp' must be a non-negative number (ms), got {value}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _hash_ids(row: Mapping[str, Any]) -> tuple[int, ...]:
    value = row["hash_ids"]
    if not isinstance(value, list):
        raise ValueError(f"field 'hash_ids' must be a list of integers, got {_describe(value)}")
    for index, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise ValueError(f"field 'hash_ids' must be a list of integers: element {index} is {_describe(item)}")
    return tuple(value)


def parse_row(row: Any) -> TraceRequest:
    """Validate one decoded JSON value; raises ``ValueError`` with the reason."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    missing = [key for key in _REQUIRED if key not in row]
    if missing:
        raise ValueError("missing field" + ("s " if len(missing) > 1 else " ") + ", ".join(repr(k) for k in missing))
    session_id = row.get("session_id")
    if session_id is not None and (isinstance(session_id, bool) or not isinstance(session_id, str | int)):
        raise ValueError(f"field 'session_id' must be a string or an integer, got {_describe(session_id)}")
    extra = {key: value for key, value in row.items() if key not in _REQUIRED and key != "session_id"}
    return TraceRequest(
        timestamp_ms=_timestamp(row),
        input_length=_non_negative_int(row, "input_length"),
        output_length=_non_negative_int(row, "output_length"),
        hash_ids=_hash_ids(row),
        session_id=session_id,
        extra=extra,
    )


def load_trace(path: str | Path, max_requests: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace, validating every line.

    Blank lines are skipped. ``max_requests`` stops after that many requests (the rest of the file is not
    read). Raises :class:`TraceError` naming the line and the reason for a malformed line, for an
    unreadable file and for a trace without a single request.
    """
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be at least 1, got {max_requests}")
    requests: list[TraceRequest] = []
    try:
        with open(path, "rb") as handle:
            for lineno, raw in enumerate(handle, start=1):
                if max_requests is not None and len(requests) >= max_requests:
                    break
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceError(path, f"not valid UTF-8 ({exc.reason} at byte {exc.start})", lineno) from None
                if not text.strip():
                    continue
                try:
                    # without its line break: a line cut short ends the document there, so the error
                    # names that column (with the break, json reports "line 2 column 1")
                    value = json.loads(text.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    raise TraceError(path, f"invalid JSON: {exc.msg} (column {exc.pos + 1})", lineno) from None
                try:
                    requests.append(parse_row(value))
                except ValueError as exc:
                    raise TraceError(path, str(exc), lineno) from None
    except OSError as exc:
        raise TraceError(path, f"cannot read trace: {exc.strerror or exc}") from None
    if not requests:
        raise TraceError(path, "the trace is empty (no requests)")
    return requests


def write_trace(path: str | Path, rows: Iterable[TraceRequest | Mapping[str, Any]]) -> int:
    """Write rows (``TraceRequest`` objects or Mooncake dicts) as JSONL; returns the number written."""
    count = 0
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for row in rows:
            data = row.to_json_dict() if isinstance(row, TraceRequest) else dict(row)
            handle.write(json.dumps(data))
            handle.write("\n")
            count += 1
    return count
