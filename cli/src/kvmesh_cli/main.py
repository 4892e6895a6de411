"""``kvmesh up | model files ... | bench ... | datagen ...``.

Each command lives in its own module and registers its own sub-parser, so this file only wires
them together. A command line that names a command builds that command's parser alone: ``kvmesh up``
imports every daemon's settings (the frontend's tokenizer pipeline among them), and a ``kvmesh bench``
run, whose CPU time is what it measures, should not pay for that. Help and mistakes build them all.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

# (module, the top-level commands it adds): each module exposes register(subparsers) adding them, with func=...
COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kvmesh_cli.up", ("up",)),
    ("kvmesh_cli.model_files", ("model",)),
    ("kvmesh_cli.certs", ("certs",)),
    ("kvmesh_cli.ops", ("status", "drain", "router")),
    ("kvmesh_bench.cli", ("bench",)),
    ("kvmesh_bench.datagen.cli", ("datagen",)),
    ("kvmesh_bench.profile", ("profile",)),
    ("kvmesh_cli.planner", ("planner",)),
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _command_modules(argv: Sequence[str]) -> list[str]:
    """The module of the command ``argv`` names (its first word not an option), else every module."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    named = [module for module, commands in COMMANDS if first in commands]
    return named or [module for module, _ in COMMANDS]


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: every command's when ``argv`` is None (help, completion, docs)."""
    parser = _Parser(prog="kvmesh", description="kvmesh: a KV-aware LLM serving mesh (tools and local runs)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    modules = _command_modules(argv) if argv is not None else [module for module, _ in COMMANDS]
    for module in modules:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; Ctrl-C wherever no command handles it (its imports take seconds) exits 130, quietly."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser(argv)
        if argv and all(arg.startswith("-") and arg not in ("-h", "--help") for arg in argv):
            parser.error(f"unrecognized arguments: {' '.join(argv)}")  # not "a command is required"
        args, extra = parser.parse_known_args(argv)
        if extra and getattr(args, "benchmark", None) is None:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if extra:  # benchmark flags belong to the benchmark's own parser
            args.args = [*extra, *args.args]
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("kvmesh: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
