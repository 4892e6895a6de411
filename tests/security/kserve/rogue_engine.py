"""A rogue engine, as in issue 15's fault campaign: it copies a real engine's discovery records under
its own lease, with its own address, and counts every gRPC call that reaches it.

Usage: rogue_engine.py DISCOVERY NAMESPACE COUNT_FILE [CERT KEY CA]
With CERT/KEY/CA it serves TLS with that certificate (e.g. a stolen non-worker mesh certificate);
without, plaintext. It prints "ready" once its records are published.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import grpc
from kvmesh.discovery import instance_prefix, model_prefix, open_discovery
from kvmesh.v1 import discovery_pb2

ROGUE_ID = 0x7E57_0000_0BAD


class CountEverything(grpc.GenericRpcHandler):
    """Answers every method: counts it (the count file is the test's evidence), then refuses."""

    def __init__(self, count_file: Path) -> None:
        self.count_file = count_file
        self.count = 0

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        self.count += 1
        self.count_file.write_text(f"{self.count} {handler_call_details.method}\n")

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "rogue")

        return grpc.stream_stream_rpc_method_handler(refuse)


async def main(url: str, namespace: str, count_file: Path, tls_files: list[str]) -> None:
    count_file.write_text("0\n")
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([CountEverything(count_file)])
    if tls_files:
        cert, key, ca = (Path(p).read_bytes() for p in tls_files)
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=False)
        port = server.add_secure_port("127.0.0.1:0", creds)
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    discovery = await open_discovery(url, ttl=2.0)
    lease = await discovery.grant_lease()
    address = f"127.0.0.1:{port}"
    records = await discovery.get_prefix(instance_prefix(namespace, "worker", "engine"))
    cards = await discovery.get_prefix(model_prefix(namespace))
    real = discovery_pb2.InstanceRecord.FromString(next(iter(records.values())))
    card_key, card_bytes = next(iter(cards.items()))
    record = discovery_pb2.InstanceRecord()
    record.CopyFrom(real)
    record.instance_id, record.lease_id, record.address = ROGUE_ID, lease.id, address
    card = discovery_pb2.ModelCard.FromString(card_bytes)
    card.address, card.engine_id = address, ROGUE_ID
    await lease.put(instance_prefix(namespace, "worker", "engine") + f"{ROGUE_ID:x}", record.SerializeToString())
    await lease.put(card_key.rsplit("/", 1)[0] + f"/{ROGUE_ID:x}", card.SerializeToString())
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4:]))
