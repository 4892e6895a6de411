"""Engine implementations behind one interface (``api.Engine``), picked by name (``registry``)."""

from .api import Engine, EngineSpec, KvNotHeld, KvPullFailed, OutputSink, OutputStream, PassObserver

__all__ = ["Engine", "EngineSpec", "KvNotHeld", "KvPullFailed", "OutputSink", "OutputStream", "PassObserver"]
