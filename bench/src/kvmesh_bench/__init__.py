"""kvmesh benchmarks: Mooncake trace I/O, the trace data synthesizer (``kvmesh datagen``) and trace replay."""

from kvmesh.grpc_core import apply_defaults

apply_defaults()  # before anything imports grpc (see kvmesh.grpc_core)
