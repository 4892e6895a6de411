"""A TLS daemon exits as soon as it has drained.

With TLS on, gRPC core's exit hook waits up to 2 s for every gRPC object of the process to be released
(``grpc_wait_for_shutdown_with_timeout``). The daemons' servers, servicers and channels form reference
cycles, and the worker and router freeze their start-up objects out of the cyclic GC, so without
``kvmesh.runtime.release_grpc_objects`` every TLS daemon sat out those 2 s after its drain. gRPC
reports the wait in its ``api`` trace: "took ..." when everything was released, "timed out" when not.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
from inference import grpc_service_pb2_grpc as kserve_grpc
from kvmesh_bench.replay.live import build_infer_request

from tests.security.tlsmesh import TlsMesh, channel

pytestmark = pytest.mark.e2e
GRPC_API_TRACE = {"GRPC_VERBOSITY": "debug", "GRPC_TRACE": "api"}


def test_every_daemon_releases_every_grpc_object_before_exiting(pki: Path, tmp_path: Path) -> None:
    mesh = TlsMesh(tmp_path, f"file://{tmp_path / 'discovery'}", f"x{uuid.uuid4().hex[:8]}", certs=pki)
    try:
        worker = mesh.wait_serving(
            mesh.start("kvmesh-worker", "worker", "--speedup-ratio", "0", "--block-size", "16", env=GRPC_API_TRACE)
        )
        router = mesh.wait_serving(mesh.start("kvmesh-router", "router", env=GRPC_API_TRACE))
        frontend = mesh.wait_serving(mesh.start("kvmesh-frontend", "frontend", env=GRPC_API_TRACE))
        planner = mesh.wait_serving(mesh.start("kvmesh-planner", "planner", env=GRPC_API_TRACE))
        # One request, so that every daemon has opened its client channels too (router session, engine stream).
        with channel(frontend.address, pki, role=None) as ch:
            request = build_infer_request("r1", np.arange(1, 40), 4, "kvmesh-mock")
            replies = list(kserve_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer(iter([request]), timeout=30))
        assert replies and not any(r.error_message for r in replies)
        for daemon in (planner, frontend, router, worker):
            daemon.close()
            assert daemon.proc.returncode == 0
            log = daemon.log_text()
            assert "grpc_wait_for_shutdown_with_timeout() took" in log, daemon.name
            assert "grpc_wait_for_shutdown_with_timeout() timed out" not in log, daemon.name
    finally:
        mesh.close()
