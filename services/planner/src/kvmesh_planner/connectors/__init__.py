"""Connectors: how the planner carries out a decision (local processes, systemd units, or virtual targets)."""
