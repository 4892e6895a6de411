"""How long a request's bytes take through a rate-capped link: what "offline + the added RTTs" leaves out.

A delay shifts every packet alike, but a rate cap makes each request pay for its own size and queue
behind the requests before it. On the multi-host harness the cap sits on the client's frontend link
(:data:`kvmesh_bench.link_conditions.CAPPED_HOST`), both ways, so before its first token a request
crosses it three times:

1. into the frontend: the client's ``ModelInferRequest`` (raw INT32 ``input_ids``: 4 bytes a token);
2. out of the frontend: the ``RouteQuery`` to a router (8 bytes a block hash);
3. out of the frontend: the ``GenerateRequest`` to the chosen worker (packed varint token ids).

:func:`capped_link_delays` runs those messages, in arrival order, through a fluid model of the link
in each direction: a FIFO token bucket (:class:`TokenBucket`) of the cap's rate and burst, as ``tbf``
shapes (``netem rate`` is the same with no burst). Each message pays its wire size, protobuf and gRPC
framing plus TCP/IP/Ethernet headers per segment. What it leaves out, each small here: the streamed
tokens and router decisions on the same link (tens of bytes per token), TCP ACKs, and TCP's own
reaction when ``tbf`` drops a burst beyond its queue (:attr:`LinkDelays.peak_backlog_bytes` says
when the model's queue went past that limit, so its figure is a floor).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from kvmesh.hashing import block_hashes
from kvmesh.v1 import router_pb2, worker_pb2

from kvmesh_bench.replay.live import build_infer_request
from kvmesh_bench.replay.workload import ReplayRequest, TokenMapper

__all__ = ["LinkDelays", "TokenBucket", "capped_link_delays", "wire_bytes"]

MSS = 1448  # TCP payload per segment on a 1500-byte MTU with timestamps
SEGMENT_OVERHEAD = 14 + 20 + 32  # Ethernet + IPv4 + TCP with timestamps, as a qdisc counts a frame
GRPC_FRAMING = 5 + 9  # gRPC length prefix + one HTTP/2 DATA frame header


def wire_bytes(message_bytes: int) -> int:
    """Bytes a gRPC message of ``message_bytes`` occupies on the link (its own segments' headers included)."""
    payload = message_bytes + GRPC_FRAMING
    segments = -(-payload // MSS)
    return payload + segments * SEGMENT_OVERHEAD


class TokenBucket:
    """A FIFO link shaped by a token bucket, as a fluid: ``rate`` bytes/s refill a bucket of ``burst`` bytes.

    A message leaves when the bucket has paid for all its bytes; the line itself is taken as infinitely
    fast (a veth). Messages must be sent in non-decreasing time order.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError(f"rate must be positive, got {rate_bytes_per_s}")
        self._rate = rate_bytes_per_s / 1000.0  # bytes per ms
        self._burst = float(burst_bytes)
        self._level = float(burst_bytes)  # tokens in the bucket at self._t
        self._t: float | None = None  # when the last message left (or was sent, if it left at once)
        self.peak_backlog_bytes = 0.0

    def send(self, t_ms: float, size: int) -> float:
        """When a message of ``size`` bytes handed to the link at ``t_ms`` has left it."""
        if self._t is None:
            start, level = t_ms, self._level
        else:
            start = max(t_ms, self._t)
            level = min(self._burst, self._level + (start - self._t) * self._rate)
        # Bytes still queued when this message arrives, itself included: what tbf's queue must hold.
        self.peak_backlog_bytes = max(self.peak_backlog_bytes, (start - t_ms) * self._rate + size - level)
        if level >= size:
            self._level, self._t = level - size, start
            return start
        done = start + (size - level) / self._rate
        self._level, self._t = 0.0, done
        return done


@dataclass(frozen=True, slots=True)
class LinkDelays:
    """Per request: ms from its arrival until its ``GenerateRequest`` has crossed the link."""

    to_worker_ms: np.ndarray
    peak_backlog_bytes: float  # the largest queue either direction needed (compare with tbf's limit)


#: Engine ids are 63-bit hashes (``kvmesh_worker.main.engine_id_for``): nearly all take 9 varint bytes, as this one.
_ENGINE_ID = (1 << 63) - 1


def _message_sizes(req: ReplayRequest, tokens: np.ndarray, model: str, block_size: int) -> tuple[int, int, int]:
    infer = build_infer_request(req.request_id, tokens, req.max_tokens, model).ByteSize()
    ids = tokens.tolist()
    query = router_pb2.RouteQuery(request_id=req.request_id, model=model, block_hashes=block_hashes(ids, block_size)[1],
                                  num_tokens=len(ids), expected_output_tokens=req.max_tokens)  # fmt: skip
    generate = worker_pb2.GenerateRequest(request_id=req.request_id, engine_id=_ENGINE_ID, token_ids=ids,
                                          sampling=worker_pb2.SamplingOptions(max_tokens=req.max_tokens))  # fmt: skip
    return wire_bytes(infer), wire_bytes(query.ByteSize()), wire_bytes(generate.ByteSize())


def capped_link_delays(
    requests: Sequence[ReplayRequest],
    mapper: TokenMapper,
    *,
    rate_mbit: float,
    burst_bytes: int,
    block_size: int,
    model: str = "kvmesh-mock",
) -> LinkDelays:
    """How long each request's messages take through the capped frontend link (see the module docstring)."""
    rate = rate_mbit * 1e6 / 8  # tc's mbit is 10^6 bits
    into, out = TokenBucket(rate, burst_bytes), TokenBucket(rate, burst_bytes)
    sizes = [_message_sizes(r, r.prompt(mapper), model, block_size) for r in requests]
    # Into the frontend: requests in arrival order. Out of it: each request's query once its request is
    # in, then its GenerateRequest once the query is out (the router's answer takes no link time here),
    # interleaved with other requests' messages in the order they reach the link.
    out_queue: list[tuple[float, int, int, int]] = []  # (time handed to the link, seq, request, stage)
    for i, r in enumerate(requests):
        heapq.heappush(out_queue, (into.send(r.arrival_ms, sizes[i][0]), 2 * i, i, 1))
    delays = np.zeros(len(requests))
    while out_queue:
        t, seq, i, stage = heapq.heappop(out_queue)
        left = out.send(t, sizes[i][stage])
        if stage == 1:
            heapq.heappush(out_queue, (left, seq + 1, i, 2))
        else:
            delays[i] = left - requests[i].arrival_ms
    return LinkDelays(delays, max(into.peak_backlog_bytes, out.peak_backlog_bytes))
