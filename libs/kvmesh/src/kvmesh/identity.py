"""Who may call what, once TLS has proved who the caller is (``kvmesh.tls``).

Invariant: with TLS on, a kvmesh service method runs only for a peer whose mesh certificate names a
role allowed for it below; anyone else gets PERMISSION_DENIED before the handler sees a message.
Methods outside the table (KServe ``inference.*``, health, reflection) are not role-checked: health
and reflection reveal nothing, and KServe has its own client authentication (``--kserve-*``).
A rogue frontend therefore cannot join router replication, and a rogue router cannot open
generate streams unless it holds a certificate the mesh CA issued for that role.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvmesh.tls import peer_role

__all__ = ["POLICY", "BearerTokenGate", "RoleGate", "allowed_roles"]

_ANY_DAEMON = frozenset({"frontend", "router", "worker", "planner", "operator"})

# method (or service prefix ending in '/') -> roles allowed to call it
POLICY: dict[str, frozenset[str]] = {
    "/kvmesh.v1.WorkerService/": frozenset({"frontend", "router", "worker", "operator"}),
    "/kvmesh.v1.WorkerService/WatchLoad": frozenset({"frontend", "router", "worker", "operator", "planner"}),
    "/kvmesh.v1.RouterService/Session": frozenset({"frontend", "operator"}),
    "/kvmesh.v1.RouterService/ReplicaSync": frozenset({"router"}),
    "/kvmesh.v1.RouterService/": frozenset({"frontend", "router", "operator", "planner"}),
    "/kvmesh.v1.AdminService/": frozenset({"operator"}),
    "/kvmesh.v1.PlannerService/": frozenset({"operator", "planner", "frontend", "router"}),
    "/kvmesh.v1.": _ANY_DAEMON,
}


def allowed_roles(method: str) -> frozenset[str] | None:
    """The roles that may call ``method``; None when the method is not role-checked."""
    best = None
    for prefix in POLICY:
        if (method == prefix or (prefix.endswith(("/", ".")) and method.startswith(prefix))) and (
            best is None or len(prefix) > len(best)
        ):
            best = prefix
    return POLICY[best] if best is not None else None


class RoleGate(grpc.aio.ServerInterceptor):
    """Checks the caller's certificate role against :data:`POLICY` before the handler runs."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        allowed = allowed_roles(handler_call_details.method)
        if handler is None or allowed is None:
            return handler
        return _wrap(handler, handler_call_details.method, allowed)


async def _check(context: grpc.aio.ServicerContext[Any, Any], method: str, allowed: frozenset[str]) -> None:
    role = peer_role(context.auth_context())
    if role not in allowed:
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{method} needs a mesh certificate of role {sorted(allowed)}, "
            + (
                f"not {role}"
                if role
                else "and none with a kvmesh role came (a frontend's KServe port asks clients for a certificate "
                "only under --kserve-client-cert)"
            ),
        )


def _wrap(handler: Any, method: str, allowed: frozenset[str]) -> Any:
    if handler.response_streaming:
        inner = handler.stream_stream if handler.request_streaming else handler.unary_stream

        async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            await _check(context, method, allowed)
            result = inner(request, context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:  # a handler that writes with context.write and returns
                await result

        factory = (
            grpc.stream_stream_rpc_method_handler if handler.request_streaming else grpc.unary_stream_rpc_method_handler
        )
        return factory(
            streaming,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    inner = handler.stream_unary if handler.request_streaming else handler.unary_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await _check(context, method, allowed)
        return await inner(request, context)

    factory = grpc.stream_unary_rpc_method_handler if handler.request_streaming else grpc.unary_unary_rpc_method_handler
    return factory(
        unary, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


class BearerTokenGate(grpc.aio.ServerInterceptor):
    """KServe client authentication by token: calls under ``prefix`` need ``authorization: Bearer <token>``.

    The comparison is constant-time; a missing or wrong token is UNAUTHENTICATED. Use it only with
    TLS on, or the token crosses the network in clear text.
    """

    def __init__(self, token: str, prefix: str = "/inference.") -> None:
        self._expected = f"Bearer {token}".encode()
        self._prefix = prefix

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given_bytes, self._expected):
            return handler
        return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


def _refusal(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler of the same shape that aborts at once (grpc.aio accepts a coroutine for streaming replies)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
