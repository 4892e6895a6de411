"""The umbrella ``kvmesh`` command: user-facing tools that sit outside the daemons."""

from kvmesh.grpc_core import apply_defaults

apply_defaults()  # before anything imports grpc (see kvmesh.grpc_core)
