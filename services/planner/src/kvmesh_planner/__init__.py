"""``kvmesh-planner``: watches the mesh and scales each worker pool to its latency targets.

The decision core (``kvmesh_planner.core``) is pure and I/O-free, so the daemon and the offline
simulation (``kvmesh_bench.planner_sim``) run the same decisions.
"""

from kvmesh.grpc_core import apply_defaults

apply_defaults()  # before anything imports grpc (see kvmesh.grpc_core)
