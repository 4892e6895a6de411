"""``kvmesh-worker``: hosts N engines (``--engine``, the mocker by default) behind one gRPC server and one lease.

Each engine is its own routable instance: it gets an engine id (derived from the process's
instance id and its index, so it is stable across lease re-grants), an instance record and a
model card in discovery. All engines share the process's lease: kill the process and all of them
disappear from discovery together.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import struct
import sys
from collections.abc import Sequence
from typing import Any

import xxhash
from kvmesh.discovery import model_key
from kvmesh.runtime import DaemonRuntime, run_daemon
from kvmesh.settings import fail
from kvmesh.v1 import discovery_pb2, worker_pb2

from kvmesh_worker.engines import Engine, EngineSpec, registry
from kvmesh_worker.metrics import EngineCollector
from kvmesh_worker.model_files import ModelFiles, ModelFilesError, load_model_files
from kvmesh_worker.service import IN_BAND, WorkerServicer
from kvmesh_worker.settings import Settings

log = logging.getLogger("kvmesh_worker")

PROG = "kvmesh-worker"


def engine_id_for(instance_id: int, index: int) -> int:
    """Stable, collision-resistant id of engine ``index`` of process ``instance_id`` (a positive int64)."""
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", instance_id, index)) & 0x7FFF_FFFF_FFFF_FFFF


_ROLES = {
    "aggregated": discovery_pb2.WORKER_ROLE_AGGREGATED,
    "prefill": discovery_pb2.WORKER_ROLE_PREFILL,
    "decode": discovery_pb2.WORKER_ROLE_DECODE,
}


def model_card(spec: EngineSpec, model: ModelFiles, engine_id: int, address: str) -> discovery_pb2.ModelCard:
    return discovery_pb2.ModelCard(
        name=model.name,
        block_size=spec.block_size,
        context_length=spec.context_length,
        total_kv_blocks=spec.total_kv_blocks,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_waiting_requests=spec.max_waiting_requests,
        vocab_size=model.vocab_size,
        eos_token_id=model.eos_token_id,
        files=list(model.files),
        files_digest=model.digest,
        capabilities=discovery_pb2.EngineCapabilities(
            kv_events=True,
            engine_kind=spec.kind,
            kv_transfer=spec.role != "aggregated",
            kv_transfer_backend="nixl" if spec.role != "aggregated" else "",
            **_agent_fields(spec),
        ),
        role=_ROLES[spec.role],
        engine_id=engine_id,
        address=address,
    )


def _agent_fields(spec: EngineSpec) -> dict[str, Any]:
    """The process's NIXL agent name and metadata, when an engine of this process moves KV."""
    if spec.role == "aggregated" or not spec.kv_transfer_agent:
        return {}
    from kvmesh_worker.kv_transfer.nixl_agent import NixlAgent  # loaded only by disaggregated workers

    agent = NixlAgent.process_agent()
    return {"kv_transfer_agent": agent.name, "kv_transfer_metadata": agent.metadata}


async def serve(cfg: Settings) -> int:
    try:
        model = load_model_files(cfg.model_path, cfg.served_model_name)
    except ModelFilesError as exc:
        fail(PROG, f"--model-path: {exc}")
    runtime = DaemonRuntime(PROG, cfg)
    # The port first: loading the engines takes up to a minute, and their own sockets must not take it meanwhile.
    port = runtime.bind(cfg.grpc_port)
    try:
        make_engine = registry.build(cfg.engine, cfg, model)
    except registry.EngineBuildError as exc:
        fail(PROG, str(exc))

    async with runtime:
        engine_ids = [engine_id_for(runtime.instance_id, i) for i in range(cfg.num_engines)]
        runners: list[Engine] = [make_engine(eid) for eid in engine_ids]
        cards: dict[int, discovery_pb2.ModelCard] = {}
        servicer = WorkerServicer(runners, cards, model, runtime.refusal, cfg.stream_interval)
        runtime.resources.push_async_callback(servicer.close)
        runtime.on_draining(servicer.drain)
        runtime.add_service(worker_pb2.DESCRIPTOR.services_by_name["WorkerService"], servicer, in_band=IN_BAND)
        runtime.resources.callback(EngineCollector.register(runners, model.name).unregister)
        await runtime.start(port)
        for runner in runners:
            runner.start()
            runtime.resources.push_async_callback(runner.stop)
        for index, eid in enumerate(engine_ids):  # before the first await: the server answers GetModelCard from here on
            cards[eid] = model_card(runners[index].spec, model, eid, runtime.address)
        for index, eid in enumerate(engine_ids):
            await runtime.register(
                runtime.instance_record(
                    "worker",
                    "engine",
                    eid,
                    role=_ROLES[runners[index].spec.role],
                    model=model.name,
                    engine_index=index,
                )
            )
            await runtime.put(model_key(cfg.namespace, model.name, eid), cards[eid].SerializeToString())
        # Everything built so far (modules, engines) lives as long as the process: keep it out of the
        # cyclic GC's full collections, each of which otherwise stalls every engine for ~15 ms (1000 engines).
        gc.collect()
        gc.freeze()
        log.info(
            "serving %d %s engine(s) of model %s on %s (instance %x)",
            len(runners),
            cfg.engine,
            model.name,
            runtime.address,
            runtime.instance_id,
        )
        if not await _serve_until_stop_or_engine_death(runtime, runners):
            return 1
        log.info("stopping: deregistering and draining in-flight requests")
    return 0


async def _serve_until_stop_or_engine_death(runtime: DaemonRuntime, runners: list[Engine]) -> bool:
    """Serve until SIGTERM/SIGINT (True) or until an engine that can die does (False).

    An engine with ``wait_dead`` (vLLM; the mocker's runner, whose loop ends only by a bug) may die under
    us. Then the worker stops serving at once:
    the gRPC server closes every call (the frontends' streams break, so their requests migrate to
    other engines) before the lease is revoked and the rest shuts down.
    """
    stop = asyncio.ensure_future(runtime.wait_for_stop())
    deaths = [asyncio.ensure_future(wait_dead()) for r in runners if (wait_dead := getattr(r, "wait_dead", None))]
    done, pending = await asyncio.wait([stop, *deaths], return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if stop in done:
        return True
    log.critical("an engine died: closing every call so that its requests migrate, then exiting")
    await runtime.server.stop(grace=0)
    return False


def main(argv: Sequence[str] | None = None) -> int:
    cfg = Settings.load(PROG, "kvmesh worker: hosts engines (the mocker by default)", argv)
    return run_daemon(PROG, cfg, serve)


if __name__ == "__main__":
    sys.exit(main())
