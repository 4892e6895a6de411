"""Engine implementations behind one interface (``api.Engine``), picked by name (``registry``)."""

from .api import Engine, EngineSpec, KvNotHeld, OutputSink, OutputStream, PassObserver

__all__ = ["Engine", "EngineSpec", "KvNotHeld", "OutputSink", "OutputStream", "PassObserver"]
