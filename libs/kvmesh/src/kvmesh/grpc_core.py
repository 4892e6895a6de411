"""The gRPC core settings every kvmesh process starts with; applied before ``grpc`` is imported.

With gRPC core's EventEngine on (grpcio 1.81's default), each message a grpc.aio process receives
crosses three threads: an EventEngine thread reads the socket, the aio poller thread takes the
completion, the event loop runs the handler. With the EventEngine experiments off, the poller thread
does the I/O itself, one hop less. Measured on this project's 2-core VM (loopback, uvloop): a bidi
ping-pong round trip p50 306 µs → 160 µs; ``kvmesh bench frontend``'s bare relay hop +0.64 ms →
+0.28 ms, the frontend's streams/s 827 → 1010 (docs/benchmarks.md, "Frontend").

gRPC core reads ``GRPC_EXPERIMENTS`` once, when ``grpc`` is first imported, so each kvmesh package's
``__init__`` calls :func:`apply_defaults` before anything imports grpc. A user's own
``GRPC_EXPERIMENTS`` always wins; set it to an empty string to run on gRPC's defaults.
"""

from __future__ import annotations

import os
import sys

EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
TUNED_EXPERIMENTS = (
    "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints,-event_engine_callback_cq"
)


def apply_defaults() -> bool:
    """Set kvmesh's gRPC core defaults for this process (and its children); False if too late or overridden."""
    if "grpc" in sys.modules or EXPERIMENTS_ENV in os.environ:
        return False
    os.environ[EXPERIMENTS_ENV] = TUNED_EXPERIMENTS
    return True
