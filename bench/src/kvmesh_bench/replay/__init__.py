"""``kvmesh bench replay`` / ``kvmesh bench compare``: Mooncake trace replay, offline (simulated) and live."""
