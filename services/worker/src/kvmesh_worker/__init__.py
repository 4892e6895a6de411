"""kvmesh worker: engines behind one interface (``kvmesh_worker.engines``) and the daemon's gRPC shell.

The built-in engine is the mocker: its core (``kvmesh_worker.engine``) is deterministic,
synchronous and I/O-free so that the same code serves a wall-clock gRPC worker
(``engine_runner.EngineRunner``) and an offline virtual-time trace replay.
"""

from kvmesh.grpc_core import apply_defaults

apply_defaults()  # before anything imports grpc (see kvmesh.grpc_core)
