"""Disaggregated meshes driven by stock tritonclient (a pytest process of their own: its stubs clash with ours)."""
