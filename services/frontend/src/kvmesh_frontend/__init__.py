"""kvmesh-frontend: the KServe v2 / Triton-compatible gRPC front door of a kvmesh deployment."""
