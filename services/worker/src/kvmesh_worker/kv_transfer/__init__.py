"""KV bytes for disaggregated serving: the mocker's block arena, block content, the process's NIXL agent.

Engine-agnostic orchestration (who pulls, who releases, cancellation) lives in ``generate_stream.py``;
this package is the mocker's side of it: real bytes in host memory, moved by NIXL (UCX over DRAM).
"""

from kvmesh_worker.kv_transfer.arena import ArenaFull, KvArena
from kvmesh_worker.kv_transfer.content import block_content, fill_block, verify_block
from kvmesh_worker.kv_transfer.sizing import model_bytes_per_block

__all__ = ["ArenaFull", "KvArena", "block_content", "fill_block", "model_bytes_per_block", "verify_block"]
