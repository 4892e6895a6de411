"""``kvmesh-planner``: watches the mesh and scales each worker pool to its latency targets."""
