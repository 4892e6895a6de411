"""The one exception type the frontend raises at a client: a gRPC status code plus a message.

Every layer (codec, LLM contract, model registry, router client, generation flow) raises
:class:`FrontendError` with the status a client should see; the servicer turns it into a gRPC status
(ModelInfer) or an in-band ``error_message`` prefixed with the status name (ModelStreamInfer).
Anything else that escapes is a bug and becomes INTERNAL with the request id.
"""

from __future__ import annotations

import grpc


class FrontendError(Exception):
    """An error with the gRPC status a client should see."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
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
