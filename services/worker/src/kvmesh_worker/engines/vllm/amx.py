"""Ask Linux for AMX tile permission in every process of a vLLM engine (x86_64 only).

vLLM's CPU attention uses AMX for bf16 with block size 32; a process that never asked for tile
permission dies with SIGILL in ``cpu_attention_with_kv_cache`` when its first forward pass has at
most 4 tokens (measured, see docs/vllm.md). The permission is per process, and vLLM spawns its
engine core, so this runs twice: in the worker before it builds the engine, and in every vLLM
process through the ``vllm.general_plugins`` entry point ``kvmesh_amx`` (services/worker/pyproject.toml),
which vLLM loads in each of its processes before the model runs.
"""

from __future__ import annotations

import ctypes
import platform

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx_permission() -> bool:
    """True when the kernel granted AMX tile data (or already had); False where AMX does not exist."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def plugin() -> None:
    """The ``vllm.general_plugins`` entry point: runs in every vLLM process."""
    request_amx_permission()
