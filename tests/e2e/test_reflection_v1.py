"""Server reflection answers under ``grpc.reflection.v1`` (what grpcurl asks first) as well as ``v1alpha``
(issue 16.5). The v1 messages are v1alpha's field for field, so v1alpha's classes encode them."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as pb

from tests.support.daemons import Daemon
from tests.support.etcd import free_port

pytestmark = pytest.mark.e2e


def _ask(channel: grpc.Channel, path: str, request: pb.ServerReflectionRequest) -> pb.ServerReflectionResponse:
    call = channel.stream_stream(
        path,
        request_serializer=pb.ServerReflectionRequest.SerializeToString,
        response_deserializer=pb.ServerReflectionResponse.FromString,
    )
    return next(iter(call(iter([request]), timeout=10)))


def test_reflection_v1_and_v1alpha(tmp_path: Path) -> None:
    port = free_port()
    args = ["--discovery", f"file://{tmp_path / 'd'}", "--grpc-port", str(port), "--namespace", "refl"]
    worker = Daemon("kvmesh-worker", args, tmp_path, port).wait_serving()
    try:
        with grpc.insecure_channel(worker.address) as channel:
            for version in ("v1", "v1alpha"):
                path = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
                listed = _ask(channel, path, pb.ServerReflectionRequest(list_services=""))
                names = {service.name for service in listed.list_services_response.service}
                assert {"kvmesh.v1.WorkerService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                        "grpc.reflection.v1alpha.ServerReflection"} <= names, (version, names)  # fmt: skip
                symbol = pb.ServerReflectionRequest(file_containing_symbol="kvmesh.v1.WorkerService")
                found = _ask(channel, path, symbol)
                files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in
                         found.file_descriptor_response.file_descriptor_proto]  # fmt: skip
                assert any(f.name == "kvmesh/v1/worker.proto" for f in files), [f.name for f in files]
                for name in names:  # each listed service can be described (grpcurl describe; v1 could not)
                    described = _ask(channel, path, pb.ServerReflectionRequest(file_containing_symbol=name))
                    assert described.file_descriptor_response.file_descriptor_proto, (version, name, described)
    finally:
        worker.close()


def test_the_frontends_reflection_describes_only_what_its_port_serves(tmp_path: Path) -> None:
    """Answered from the whole process, the public KServe port gave anyone the mesh's internal contracts
    by file name (router.proto's Session and ReplicaSync, worker.proto's GenerateStream)."""
    port = free_port()
    args = ["--discovery", f"file://{tmp_path / 'd'}", "--grpc-port", str(port), "--namespace", "refl"]
    frontend = Daemon("kvmesh-frontend", args, tmp_path, port).wait_started()  # alone: up, not ready
    try:
        with grpc.insecure_channel(frontend.address) as channel:
            path = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
            symbol = pb.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService")
            assert _ask(channel, path, symbol).file_descriptor_response.file_descriptor_proto
            for internal in ("kvmesh/v1/router.proto", "kvmesh/v1/worker.proto", "kvmesh/v1/discovery.proto"):
                answer = _ask(channel, path, pb.ServerReflectionRequest(file_by_filename=internal))
                assert answer.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0], (internal, answer)
    finally:
        frontend.close()
