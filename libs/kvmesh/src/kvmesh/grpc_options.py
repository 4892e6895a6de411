"""Channel and server options every kvmesh gRPC endpoint uses.

Keepalive pings detect a dead peer (a kill -9'd worker, a cut cable) in seconds instead of the
kernel's TCP timeout, which is what makes mid-stream migration and router failover fast. Message
limits are generous because snapshots of a 16k-block cache and long prompts are legitimately large.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Both ends of every connection: the same message limits and keepalive pings.
_BOTH_ENDS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # gRPC core (1.81) waits for a keepalive ping's answer this long, not keepalive_timeout_ms (default
    # 60 s): without it a frozen peer (SIGSTOP, a wedged process whose kernel still ACKs) held its
    # streams, and the requests on them, for minutes instead of ~15 s.
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

CLIENT_OPTIONS: list[tuple[str, int]] = [
    *_BOTH_ENDS,
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.initial_reconnect_backoff_ms", 100),
    # Connections of their own: gRPC otherwise shares a connection (subchannel) between channels of one
    # target and options, so a peer restarted on a dead one's address (a new instance id, a new channel)
    # failed its first call with the dead one's "connection refused" while that channel was backing off.
    ("grpc.use_local_subchannel_pool", 1),
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    *_BOTH_ENDS,
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    # Two daemons must never silently share a port.
    ("grpc.so_reuseport", 0),
]

# The KServe frontend takes requests from the public, and every byte of a request is received,
# assembled and copied before any handler can look at it: a 64 MiB message costs the frontend
# ~0.2-0.3 s of event loop and ~260 MB of peak RSS per request in flight (measured, issue 14). Its
# largest legitimate request is far smaller: a 1M-token prompt is 4 MiB of INT32 ids or a few MiB of
# text. gRPC answers anything larger with RESOURCE_EXHAUSTED before the frontend sees it.
FRONTEND_MAX_RECEIVE_BYTES = 16 * 1024 * 1024

FRONTEND_SERVER_OPTIONS: list[tuple[str, int]] = [
    (key, FRONTEND_MAX_RECEIVE_BYTES if key == "grpc.max_receive_message_length" else value)
    for key, value in SERVER_OPTIONS
]
