"""argparse ``type=`` checkers the bench commands share, so a bad number reads the same everywhere."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["fleet_sizes", "non_negative_int", "output_file", "positive_float", "positive_floats", "positive_int"]

N = TypeVar("N", int, float)


def _checked(parse: Callable[[str], N], ok: Callable[[N], bool], expected: str, must: str) -> Callable[[str], N]:
    def check(text: str) -> N:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {text}")
        return value

    return check


positive_int = _checked(int, lambda v: v >= 1, "an integer", "at least 1")
non_negative_int = _checked(int, lambda v: v >= 0, "an integer", "non-negative")
positive_float = _checked(float, lambda v: v > 0 and not math.isinf(v), "a number", "a positive number")


def positive_floats(text: str) -> list[float]:
    """Comma-separated positive numbers (``1,2,4.5``): at least one."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(v > 0 and math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"need at least one number, each positive, got {text!r}")
    return values


def fleet_sizes(text: str) -> list[int]:
    """Comma-separated fleet sizes (``8,128,1000``): at least one, each at least 1."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"need at least one size, each at least 1, got {text!r}")
    return sizes


def output_file(text: str) -> Path:
    """A file a command will write (``--json``): refused at once if it cannot be one, not after the run.

    Missing parent directories are fine (the writers create them); an existing directory, or a parent
    that is a file, is not.
    """
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file to write")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} is not a directory")
            break
    return path
