"""Helpers for benches that start a local deployment of kvmesh daemons as child processes."""

from __future__ import annotations

import os
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


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used, from /proc (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0
