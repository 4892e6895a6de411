"""The umbrella ``kvmesh`` command: user-facing tools that sit outside the daemons."""
