"""gRPC server reflection under both names clients ask for: ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection (1.81) ships only ``v1alpha``; current grpcurl, grpc_cli and Postman ask for ``v1``
first. The two protocols are the same messages under another package name (field for field, so the
same bytes on the wire), so one ``v1alpha`` servicer answers both method paths.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as pb

from kvmesh import grpc_services

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
SERVICE_NAMES = (V1_SERVICE_NAME, reflection.SERVICE_NAME)


def enable_server_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection over ``service_names`` (both reflection services are listed too) as v1 and v1alpha.

    It describes those services and the files they need, nothing else: answered from the process's
    whole descriptor pool, the frontend's public KServe port gave anyone every internal contract of the
    mesh (router.proto's Session and ReplicaSync, worker.proto's GenerateStream, ...) by file name.
    """
    names = list(dict.fromkeys([*service_names, *SERVICE_NAMES]))
    servicer = reflection.aio.ReflectionServicer(names, pool=_pool_of(names))
    for name in SERVICE_NAMES:
        grpc_services.add_service(server, pb.DESCRIPTOR.services_by_name["ServerReflection"], servicer, name=name)


def _pool_of(service_names: Sequence[str]) -> descriptor_pool.DescriptorPool:
    """A descriptor pool with the files of ``service_names`` and their imports only."""
    default = descriptor_pool.Default()  # type: ignore[no-untyped-call]
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name in added:
            return
        added.add(file.name)
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)  # type: ignore[no-untyped-call]
        pool.Add(proto)  # type: ignore[no-untyped-call]

    for name in service_names:
        try:
            add(default.FindServiceByName(name).file)
        except KeyError:  # grpc.reflection.v1: described below
            continue
    # v1 as grpcio-reflection lacks it: v1alpha's file under v1's package, so that `grpcurl describe` of
    # every listed service works (the listed v1 name could not be described).
    v1 = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(v1)  # type: ignore[no-untyped-call]
    v1.name, v1.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    alpha, one = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for message in v1.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # (assigning it, even "", would mark a scalar as a message)
                field.type_name = field.type_name.replace(alpha, one)
    for method in v1.service[0].method:
        method.input_type, method.output_type = (
            method.input_type.replace(alpha, one),
            method.output_type.replace(alpha, one),
        )
    pool.Add(v1)  # type: ignore[no-untyped-call]
    return pool
