"""gRPC server reflection under both names clients ask for: ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection (1.81) ships only ``v1alpha``; current grpcurl, grpc_cli and Postman ask for ``v1``
first. The two protocols are the same messages under another package name (field for field, so the
same bytes on the wire), so one ``v1alpha`` servicer answers both method paths.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as pb

from kvmesh import grpc_services

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
SERVICE_NAMES = (V1_SERVICE_NAME, reflection.SERVICE_NAME)


def enable_server_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection over ``service_names`` (both reflection services are listed too) as v1 and v1alpha."""
    names = list(dict.fromkeys([*service_names, *SERVICE_NAMES]))
    servicer = reflection.aio.ReflectionServicer(names)
    for name in SERVICE_NAMES:
        grpc_services.add_service(server, pb.DESCRIPTOR.services_by_name["ServerReflection"], servicer, name=name)
