"""kvmesh worker: a simulated vLLM engine (the mocker) behind the worker daemon's I/O shell.

The engine core (``kvmesh_worker.engine``) is deterministic, synchronous and I/O-free so that the
same code serves a wall-clock gRPC worker and an offline virtual-time trace replay.
"""

from kvmesh.grpc_core import apply_defaults

apply_defaults()  # before anything imports grpc (see kvmesh.grpc_core)
