"""``kvmesh up | model files ... | bench ... | datagen ...``.

Each command lives in its own module and registers its own sub-parser, so this file only wires
them together; importing a command's heavy dependencies happens when it runs, not at start-up.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

# (module, attribute): each exposes register(subparsers) adding one command with func=...
COMMANDS: tuple[tuple[str, str], ...] = (
    ("kvmesh_cli.up", "register"),
    ("kvmesh_cli.model_files", "register"),
    ("kvmesh_cli.certs", "register"),
    ("kvmesh_cli.ops", "register"),
    ("kvmesh_bench.cli", "register"),
    ("kvmesh_bench.datagen.cli", "register"),
    ("kvmesh_bench.profile", "register"),
    ("kvmesh_cli.planner", "register"),
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvmesh", description="kvmesh: a KV-aware LLM serving mesh (tools and local runs)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module, attr in COMMANDS:
        getattr(importlib.import_module(module), attr)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "benchmark", None) is None:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:  # benchmark flags belong to the benchmark's own parser
        args.args = [*extra, *args.args]
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
