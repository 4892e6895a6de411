"""kvmesh benchmarks: Mooncake trace I/O, the trace data synthesizer (``kvmesh datagen``) and trace replay."""
