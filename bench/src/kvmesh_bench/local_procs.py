"""Helpers for benches that start a local deployment of kvmesh daemons as child processes."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def script(name: str) -> str:
    """The console script ``name`` of this interpreter's environment, else the one on PATH."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else (shutil.which(name) or name)
