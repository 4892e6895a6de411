"""Prefill and decode roles of the vLLM engine: vLLM's own ``NixlConnector`` moves the KV.

kvmesh's disaggregation contract (docs/disaggregation.md) stays as it is: the frontend runs a prefill
leg with ``hold_kv_for_transfer``, takes ``KvTransferParams`` from its last response and hands them to
the decode leg as ``prefill_result``. With vLLM, the bytes move engine to engine, inside vLLM: the
prefill engine (``kv_role="kv_producer"``) returns its ``kv_transfer_params`` dict on the request's last
output, kvmesh carries it verbatim in ``KvTransferParams.engine_params_json``, and the decode engine
(``kv_role="kv_consumer"``) gets it back in ``SamplingParams.extra_args["kv_transfer_params"]``, which
makes its scheduler pull the blocks through NIXL (a READ over UCX, host memory on CPU) before it samples.

Invariants:

- one NIXL side channel per engine: the worker sets ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (``--host``) and a
  free ``VLLM_NIXL_SIDE_CHANNEL_PORT`` before vLLM spawns its engine core, unless they are set;
- the hold is vLLM's: the prefill engine keeps the blocks until the decode engine's read notice or its
  lease, ``kv_lease_duration`` = ``--kv-hold-timeout`` (vLLM heartbeats while the decode side queues).
  ``ReleaseKv`` only ends kvmesh's bookkeeping of the hold: vLLM has no call that frees a finished
  request's blocks early;
- the params are checked, never altered: a decode request whose ``engine_params_json`` is not a vLLM
  remote-prefill dict, or whose prompt length or block size differ from the prefill's, is refused
  (INVALID_ARGUMENT / FAILED_PRECONDITION) before it reaches vLLM.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from kvmesh.hashing import block_hashes
from kvmesh.ports import free_port
from kvmesh.v1.kv_transfer_pb2 import KvTransferParams, KvTransferReport

from kvmesh_worker.engines.api import KvPullFailed, Role
from kvmesh_worker.engines.registry import EngineBuildError

CONNECTOR = "NixlConnector"
_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# vLLM heartbeats every lease // 6 seconds; a shorter lease would heartbeat continuously.
MIN_LEASE_S = 6
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def lease_seconds(hold_timeout_s: float) -> int:
    return max(MIN_LEASE_S, math.ceil(hold_timeout_s))


def kv_transfer_config(role: Role, user: Any, hold_timeout_s: float, cpu: bool) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_config`` for a role: NixlConnector, the role's ``kv_role``, the hold lease.

    The user's own ``kv_transfer_config`` (``--vllm-engine-args``) is kept, e.g. ``kv_buffer_device`` or
    ``kv_connector_extra_config.backends``; only the connector and the role are kvmesh's.
    """
    if role == "aggregated":
        return dict(user) if isinstance(user, dict) else user
    config = dict(user) if isinstance(user, dict) else {}
    if config.get("kv_connector", CONNECTOR) != CONNECTOR:
        raise EngineBuildError(
            f"--role {role} with --engine vllm moves KV through vLLM's {CONNECTOR}; "
            f"kv_transfer_config.kv_connector {config['kv_connector']!r} is not supported"
        )
    config["kv_connector"] = CONNECTOR
    config["kv_role"] = _KV_ROLES[role]
    if cpu:
        config.setdefault("kv_buffer_device", "cpu")  # the CPU build has no device memory
    extra = dict(config.get("kv_connector_extra_config") or {})
    extra.setdefault("kv_lease_duration", lease_seconds(hold_timeout_s))
    config["kv_connector_extra_config"] = extra
    return config


def side_channel_env(host: str) -> None:
    """This engine's NIXL side channel (vLLM reads the env vars in its spawned engine core)."""
    if "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port(host))
    os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", host)
    if host in _LOOPBACK:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")  # one machine: keep UCX's TCP lane on loopback
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def prefill_extra_args() -> dict[str, Any]:
    """The prefill leg's ``extra_args`` (a fresh dict: vLLM may write into it): keep the blocks, say where."""
    return {"kv_transfer_params": {"do_remote_decode": True}}


def held_params(
    engine_id: int,
    transfer_id: str,
    prompt: list[int],
    block_size: int,
    vllm_params: dict[str, Any],
    hold_timeout_s: float,
) -> KvTransferParams:
    """The prefill leg's ``KvTransferParams``: vLLM's dict verbatim, plus kvmesh's view of the hold."""
    groups = vllm_params.get("remote_block_ids") or []
    first = groups[0] if groups and isinstance(groups[0], (list, tuple)) else groups
    _, sequence = block_hashes(prompt, block_size)
    return KvTransferParams(
        backend="nixl",
        source_engine_id=engine_id,
        agent_name=str(vllm_params.get("remote_engine_id", "")),
        block_ids=[int(b) for b in first],
        num_tokens=len(prompt),
        engine_params_json=json.dumps(vllm_params),
        transfer_id=transfer_id,
        block_hashes=sequence[: len(first)],
        block_size=block_size,
        hold_expires_unix_ms=int((time.time() + lease_seconds(hold_timeout_s)) * 1000),
        hold_remaining_ms=int(lease_seconds(hold_timeout_s) * 1000),
    )


def remote_prefill(
    prompt: list[int], params: KvTransferParams, block_size: int, cached: set[int]
) -> tuple[dict[str, Any], KvTransferReport]:
    """The decode leg's vLLM ``kv_transfer_params`` and its report; raises KvPullFailed.

    ``cached``: the sequence hashes this engine caches (its KV-event index). The report's split into
    local hits and transferred blocks is the one vLLM's scheduler makes (it pulls only the blocks past
    its own cached prefix); vLLM's measured counts are the engine's ``kv_pulled_*`` counters.
    """
    try:
        value = json.loads(params.engine_params_json or "null")
    except ValueError:
        value = None
    if not isinstance(value, dict) or not value.get("do_remote_prefill"):
        raise KvPullFailed(
            "INVALID_ARGUMENT",
            "the prefill result carries no vLLM kv_transfer_params (engine_params_json): a vLLM decode engine "
            "needs a vLLM prefill engine (--engine vllm --role prefill)",
        )
    if params.num_tokens and params.num_tokens != len(prompt):
        raise KvPullFailed(
            "INVALID_ARGUMENT",
            f"the prefill result holds {params.num_tokens} prompt tokens, this prompt has {len(prompt)}",
        )
    if params.block_size and params.block_size != block_size:
        raise KvPullFailed(
            "FAILED_PRECONDITION",
            f"the prefill engine's block size is {params.block_size}, this engine's {block_size}",
        )
    offered = len(params.block_ids)
    _, sequence = block_hashes(prompt, block_size)
    local = 0
    for seq in sequence[:offered]:
        if seq not in cached:
            break
        local += 1
    report = KvTransferReport(
        source_engine_id=params.source_engine_id,
        offered_blocks=offered,
        local_hit_blocks=local,
        transferred_blocks=offered - local,
    )
    return value, report
