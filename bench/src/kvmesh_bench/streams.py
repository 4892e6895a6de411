"""Reading grpc.aio bidi streams by hand, the way the benches' clients do (``call.read()`` / ``EOF``)."""

from __future__ import annotations

from typing import Any, TypeVar, cast

import grpc

__all__ = ["EOF", "drain", "read_message"]

EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # grpc.aio exports EOF at runtime; types-grpcio omits it

T = TypeVar("T")


async def read_message(call: Any, kind: type[T], peer: str = "the server") -> T:
    """The next message of ``call``, a ``kind``; an EOF means ``peer`` ended the stream too early."""
    message = await call.read()
    if message is EOF:
        raise RuntimeError(f"{peer} closed the stream")
    # types-grpcio types read() as object | response (its EOF type is object), so `is` cannot narrow it
    return cast(T, message)


async def drain(call: Any) -> None:
    """Read ``call`` to its end (after ``done_writing``), so the RPC finishes cleanly on both sides."""
    while await call.read() is not EOF:
        pass
