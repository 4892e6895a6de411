"""The one exception type the frontend raises at a client: a gRPC status code plus a message.

Every layer (codec, LLM contract, model registry, router client, generation flow) raises
:class:`FrontendError` with the status a client should see; the servicer turns it into a gRPC status
(ModelInfer) or an in-band ``error_message`` prefixed with the status name (ModelStreamInfer).
Anything else that escapes is a bug and becomes INTERNAL with the request id.

Messages are bounded: a value echoed from the request goes through :func:`clip`, and the whole
message is cut to :data:`MAX_MESSAGE_BYTES`, because a gRPC status message travels in a trailer and
a client refuses trailers over its metadata limit (8 KiB by default), turning a clear NOT_FOUND into
a confusing RESOURCE_EXHAUSTED. Text that peers' gRPC errors carry for debugging
(``debug_error_string``) is cut off here too, as a last line of defence.
"""

from __future__ import annotations

import grpc

MAX_ECHO_CHARS = 64
# UTF-8 bytes of a message; percent-encoded in the trailer (x3 at worst), it stays under 8 KiB.
MAX_MESSAGE_BYTES = 1024
_DEBUG_MARKERS = ("debug_error_string", "<AioRpcError of RPC", "<_InactiveRpcError of RPC")


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``value`` as a client may see it echoed in a message: at most ``limit`` characters of it."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def _bounded(message: str) -> str:
    for marker in _DEBUG_MARKERS:
        cut = message.find(marker)
        if cut >= 0:
            message = message[:cut].rstrip(" ,;:({[\"'") + " (details in the frontend log)"
    data = message.encode("utf-8", "replace")
    if len(data) <= MAX_MESSAGE_BYTES:
        return message
    return data[: MAX_MESSAGE_BYTES - 3].decode("utf-8", "ignore") + "..."


class FrontendError(Exception):
    """An error with the gRPC status a client should see (its message bounded and free of peer debug text)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        message = _bounded(message)
        super().__init__(message)
        self.code = code
        self.message = message

    def in_band(self) -> str:
        """The ModelStreamInfer ``error_message`` form: ``STATUS_NAME: message``."""
        return f"{self.code.name}: {self.message}"

    def __repr__(self) -> str:
        return f"FrontendError({self.code.name}, {self.message!r})"


def invalid(message: str) -> FrontendError:
    return FrontendError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> FrontendError:
    return FrontendError(grpc.StatusCode.NOT_FOUND, message)


def unavailable(message: str) -> FrontendError:
    return FrontendError(grpc.StatusCode.UNAVAILABLE, message)


def exhausted(message: str) -> FrontendError:
    return FrontendError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def internal(message: str) -> FrontendError:
    return FrontendError(grpc.StatusCode.INTERNAL, message)


def failure_line(exc: BaseException) -> str:
    """One line for the log about a failed call to a peer: a gRPC error's code and details, not its
    multi-line repr (with ``debug_error_string``)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
