"""kvmesh-frontend: the KServe v2 / Triton-compatible gRPC front door of a kvmesh deployment."""

from kvmesh.grpc_core import apply_defaults

apply_defaults()  # before anything imports grpc (see kvmesh.grpc_core)
