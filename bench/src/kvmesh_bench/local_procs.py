"""Helpers for benches that start a local deployment of kvmesh daemons as child processes."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


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
