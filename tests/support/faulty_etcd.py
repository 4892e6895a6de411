"""An etcd endpoint that answers a single-key read and refuses every range: a backend that connects, then
fails the listing (a response over a limit, a permission, a timeout). For the operator CLI's error path.

It speaks etcd's own ``etcdserverpb.KV/Range`` over real gRPC (aetcd's stubs): the kvmesh client's connect
probe reads one key and gets an empty answer; a prefix listing gets ``RESOURCE_EXHAUSTED``::

    with FaultyEtcd() as etcd:
        run_cli("kvmesh", "status", "--discovery", etcd.url)
"""

from __future__ import annotations

from concurrent import futures
from types import TracebackType
from typing import Any

import grpc
from aetcd.rpc import rpc_pb2, rpc_pb2_grpc

from tests.support.etcd import free_port


class _KV(rpc_pb2_grpc.KVServicer):
    def Range(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.range_end:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "grpc: received message larger than max")
        return rpc_pb2.RangeResponse(header=rpc_pb2.ResponseHeader(revision=1))


class FaultyEtcd:
    def __init__(self) -> None:
        self.port = free_port()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        rpc_pb2_grpc.add_KVServicer_to_server(_KV(), self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultyEtcd:
        self._server.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._server.stop(grace=None)
