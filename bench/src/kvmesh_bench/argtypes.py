"""argparse pieces the ``kvmesh`` commands share: ``type=`` checkers, so a bad number reads the same
everywhere, and a parser whose errors are one line."""

from __future__ import annotations

import argparse
import math
import shlex
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

__all__ = [
    "CommandParser",
    "fractions",
    "non_negative_float",
    "non_negative_int",
    "output_file",
    "png_file",
    "positive_float",
    "positive_floats",
    "positive_int",
    "positive_ints",
    "shell_words",
    "tcp_port",
    "unit_fraction",
]

N = TypeVar("N", int, float)


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose error is one line (``prog: error: ...``, exit 2), as the daemons' are:
    the usage it would print first is what ``--help`` is for."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


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
non_negative_float = _checked(float, lambda v: 0 <= v < math.inf, "a number", "a finite number, 0 or more")
unit_fraction = _checked(float, lambda v: 0 < v <= 1, "a number", "above 0 and at most 1")
tcp_port = _checked(int, lambda v: 1 <= v <= 65535, "a port number", "1-65535")


def shell_words(text: str) -> str:
    """Flags for another command, as one shell-quoted string (kept as given; it must split)."""
    try:
        shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"cannot split {text!r} into words: {exc}") from None
    return text


def _comma_list(
    parse: Callable[[str], N], ok: Callable[[N], bool], expected: str, must: str
) -> Callable[[str], list[N]]:
    """A checker of comma-separated values (``1,2,4``): at least one, each ``ok``."""

    def check(text: str) -> list[N]:
        try:
            values = [parse(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {expected}, got {text!r}") from None
        if not values or not all(map(ok, values)):
            raise argparse.ArgumentTypeError(f"need at least one, each {must}, got {text!r}")
        return values

    return check


positive_ints = _comma_list(int, lambda v: v >= 1, "integers", "at least 1")  # 32,64,128
positive_floats = _comma_list(float, lambda v: v > 0 and math.isfinite(v), "numbers", "positive")  # 1,2,4.5
fractions = _comma_list(float, lambda v: 0 <= v < 1, "numbers", "from 0 up to (not including) 1")  # 0,0.5


def output_file(text: str) -> Path:
    """A file a command will write (``--json``): refused at once if it cannot be one, not after the run.

    Missing parent directories are fine (the writers create them); an existing directory, a parent that
    is a file, or one this process cannot write in, is not: the run would end in a traceback, its results
    lost.
    """
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("an empty path is no file to write")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file to write")
    if path.exists():  # a file already there must be one this process may overwrite (not read-only)
        try:
            with path.open("a"):
                pass
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot write {text}: {exc.strerror or exc}") from None
        return path
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} is not a directory")
            try:  # the one sure test (root passes every permission check, yet cannot write in /proc)
                with tempfile.TemporaryFile(dir=parent):
                    pass
            except OSError as exc:
                raise argparse.ArgumentTypeError(f"cannot write {text}: {exc.strerror or exc}") from None
            break
    return path


def pem_file(text: str) -> bytes:
    """A PEM file to read now (``--tls-ca``): its bytes; refused at once if it is missing or holds no PEM."""
    try:
        data = Path(text).read_bytes()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise argparse.ArgumentTypeError(f"{text}: no PEM block (a certificate or key file is expected)")
    return data


def png_file(text: str) -> Path:
    """A PNG a command will write (``--plot``): an :func:`output_file` named ``*.png`` (matplotlib would
    otherwise add the suffix itself, and the command name a file it never wrote)."""
    path = output_file(text)
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{text!r}: a PNG file's name ends in .png")
    return path
