"""Live replay: an open-loop KServe v2 client that sends a trace to a running frontend at its timestamps.

One ``ModelStreamInfer`` stream carries every request (the frontend serves each in its own task and
tags every response with the request's ``id``). Request ``i`` is written at ``start + arrival_ms[i]``
whether or not earlier ones have finished (open loop); its prompt is the workload's token ids
(``input_ids``, INT32), with ``sampling_parameters = {"max_tokens": output_length, "ignore_eos": true}``,
``stream=true``, ``exclude_input_in_output=true`` and ``return_num_output_tokens=true`` (so merged
responses still count their tokens).

Timing is taken on the client: TTFT from the *scheduled* send time (a client that falls behind is
charged for it; the lag, from the scheduled time until gRPC has taken the request's message, is
reported as p50 / p99 / max: a frontend slow to read holds the client's writes back too) to the first
response that carries tokens, a response's gap to
the previous one divided evenly among its tokens (ITL), end-to-end to the final response. The final
response's ``kvmesh.worker_id`` and ``kvmesh.cached_tokens`` give the engine and the router's cached
prefix (the hit rate a client can see).

Bounds: ``max_requests`` (the caller slices the trace) and ``duration_s`` (no request is sent after
that many seconds); then the stream half-closes and in-flight requests get ``drain_timeout_s`` to
finish before the stream is cancelled (the rest count as failed).

The client uses kvmesh's own generated stubs (``inference.grpc_service_pb2``), no tritonclient.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from inference import grpc_service_pb2 as kserve
from inference import grpc_service_pb2_grpc as kserve_grpc

from kvmesh_bench.replay.report import RunData
from kvmesh_bench.replay.workload import ReplayRequest, TokenMapper

__all__ = ["HIT_SOURCE", "FrontendUnreachable", "LiveOptions", "build_infer_request", "probe_frontend", "run_live"]

HIT_SOURCE = "router overlap reported by the frontend (kvmesh.cached_tokens)"
_MAX_MESSAGE = 64 * 1024 * 1024
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE)]


class FrontendUnreachable(Exception):
    """The frontend does not answer, is not ready, or does not serve the model (a one-line reason)."""


@dataclass(frozen=True, slots=True)
class LiveOptions:
    frontend: str
    model: str = "kvmesh-mock"
    router_mode: str | None = None  # sent as the kvmesh.router_mode request parameter; None: the router's own
    router_policy: str | None = None  # sent as kvmesh.router_policy (kv cost policy); None: the router's own
    duration_s: float | None = None
    drain_timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    stream_interval: int = 1  # sampling_parameters.stream_interval (1: not sent, one response per engine output)
    progress: bool = True
    engines_hint: int = 0  # engines expected (sizes the per-engine columns; grows as more are seen)
    credentials: grpc.ChannelCredentials | None = None  # TLS to the frontend; None: plaintext


@dataclass
class _Track:
    sent_at: float = math.nan  # actual write time (perf_counter seconds)
    first: float = math.nan
    last: float = math.nan
    finish: float = math.nan
    tokens: int = 0
    worker: int | None = None
    cached: int = 0
    error: str | None = None
    gaps: list[tuple[float, int]] = field(default_factory=list)


def _bool_input(name: str) -> tuple[kserve.ModelInferRequest.InferInputTensor, bytes]:
    return kserve.ModelInferRequest.InferInputTensor(name=name, datatype="BOOL", shape=[1]), b"\x01"


def build_infer_request(
    request_id: str,
    tokens: np.ndarray,
    max_tokens: int,
    model: str,
    router_mode: str | None = None,
    router_policy: str | None = None,
    sampling: Mapping[str, object] | None = None,
) -> kserve.ModelInferRequest:
    """The ModelInferRequest for one replayed request (raw tensors, as Triton clients send them);
    ``sampling``: more ``sampling_parameters`` keys (e.g. ``stream_interval``)."""
    req = kserve.ModelInferRequest(model_name=model, id=request_id)
    ids = np.ascontiguousarray(tokens, dtype="<i4")
    inputs = [
        (kserve.ModelInferRequest.InferInputTensor(name="input_ids", datatype="INT32", shape=[ids.size]), ids.tobytes())
    ]
    parameters = json.dumps({"max_tokens": int(max_tokens), "ignore_eos": True, **(sampling or {})}).encode()
    inputs.append(
        (
            kserve.ModelInferRequest.InferInputTensor(name="sampling_parameters", datatype="BYTES", shape=[1]),
            struct.pack("<I", len(parameters)) + parameters,
        )
    )
    for name in ("stream", "exclude_input_in_output", "return_num_output_tokens"):
        inputs.append(_bool_input(name))
    for tensor, raw in inputs:
        req.inputs.append(tensor)
        req.raw_input_contents.append(raw)
    if router_mode:
        req.parameters["kvmesh.router_mode"].string_param = router_mode
    if router_policy:
        req.parameters["kvmesh.router_policy"].string_param = router_policy
    return req


def _param(response: kserve.ModelInferResponse, key: str) -> object | None:
    p = response.parameters.get(key)
    if p is None:
        return None
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which else None


def _num_tokens(response: kserve.ModelInferResponse) -> int:
    for i, out in enumerate(response.outputs):
        if out.name == "num_output_tokens":
            if i < len(response.raw_output_contents) and len(response.raw_output_contents[i]) >= 4:
                return int(struct.unpack_from("<I", response.raw_output_contents[i])[0])
            if out.contents.uint_contents:
                return int(out.contents.uint_contents[0])
    return 0


async def probe_frontend(channel: grpc.aio.Channel, model: str, timeout_s: float) -> None:
    """Raise :class:`FrontendUnreachable` unless the frontend answers and serves ``model``."""
    stub = kserve_grpc.GRPCInferenceServiceStub(channel)
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
        ready = await stub.ServerReady(kserve.ServerReadyRequest(), timeout=timeout_s)
        if not ready.ready:
            raise FrontendUnreachable("the frontend answers but is not ready")
        model_ready = await stub.ModelReady(kserve.ModelReadyRequest(name=model), timeout=timeout_s)
    except TimeoutError:
        raise FrontendUnreachable(f"no answer within {timeout_s:g} s") from None
    except grpc.aio.AioRpcError as exc:
        raise FrontendUnreachable(f"{exc.code().name}: {exc.details()}") from None
    if not model_ready.ready:
        raise FrontendUnreachable(f"model {model!r} is not ready (no live engine serves it)")


async def run_live(
    requests: Sequence[ReplayRequest], mapper: TokenMapper, options: LiveOptions, label: str = ""
) -> RunData:
    """Replay ``requests`` against the frontend; raises :class:`FrontendUnreachable` before sending anything."""
    cpu0 = time.process_time()
    channel_of = (
        grpc.aio.insecure_channel(options.frontend, options=_CHANNEL_OPTIONS)
        if options.credentials is None
        else grpc.aio.secure_channel(options.frontend, options.credentials, options=_CHANNEL_OPTIONS)
    )
    async with channel_of as channel:
        await probe_frontend(channel, options.model, options.connect_timeout_s)
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        tracks = {r.request_id: _Track() for r in requests}
        pending = set(tracks)
        all_done = asyncio.Event()
        if not requests:
            all_done.set()
        bar = _progress(len(requests), options.progress)
        call = stub.ModelStreamInfer()

        def finish(rid: str, now: float, error: str | None = None) -> None:
            t = tracks[rid]
            t.finish = now
            t.error = error
            pending.discard(rid)
            if bar is not None:
                bar.update(1)
            if not pending:
                all_done.set()

        async def reader() -> None:
            async for reply in call:
                now = time.perf_counter()
                resp = reply.infer_response
                rid = resp.id
                t = tracks.get(rid)
                if t is None or rid not in pending:
                    continue
                if reply.error_message:
                    finish(rid, math.nan, reply.error_message)
                    continue
                n = _num_tokens(resp)
                if n:
                    if math.isnan(t.first):
                        t.first = now
                    else:
                        t.gaps.append(((now - t.last) / n, n))
                    t.last = now
                    t.tokens += n
                final = _param(resp, "triton_final_response")
                if final:
                    worker = _param(resp, "kvmesh.worker_id")
                    t.worker = int(worker) if isinstance(worker, int | float) else None
                    cached = _param(resp, "kvmesh.cached_tokens")
                    t.cached = int(cached) if isinstance(cached, int | float) else 0
                    finish(rid, now)

        read_task = asyncio.create_task(reader())
        start = time.perf_counter()
        stop_at = start + options.duration_s if options.duration_s is not None else math.inf
        lags: list[float] = []
        sent = 0
        try:
            for r in requests:
                due = start + r.arrival_ms / 1000.0
                if due >= stop_at:
                    break
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if read_task.done():
                    break  # the stream broke; the reader's exception is raised below
                msg = build_infer_request(
                    r.request_id,
                    r.prompt(mapper),
                    r.max_tokens,
                    options.model,
                    options.router_mode,
                    options.router_policy,
                    {"stream_interval": options.stream_interval} if options.stream_interval > 1 else None,
                )
                tracks[r.request_id].sent_at = time.perf_counter()
                await call.write(msg)
                lags.append(time.perf_counter() - due)
                sent += 1
            for r in requests[sent:]:  # never sent (duration reached)
                pending.discard(r.request_id)
                tracks[r.request_id].error = "not sent (duration reached)"
            if not pending:
                all_done.set()
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.done_writing()
            waiter = asyncio.ensure_future(all_done.wait())
            await asyncio.wait({read_task, waiter}, timeout=options.drain_timeout_s, return_when="FIRST_COMPLETED")
            waiter.cancel()
        finally:
            if bar is not None:
                bar.close()
            call.cancel()
            read_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await read_task
        stream_error = None
        if read_task.done() and not read_task.cancelled() and read_task.exception() is not None:
            stream_error = str(read_task.exception())
    return _to_run(requests, tracks, start, options, label, sent, lags, stream_error, time.process_time() - cpu0)


def _to_run(
    requests: Sequence[ReplayRequest],
    tracks: dict[str, _Track],
    start: float,
    options: LiveOptions,
    label: str,
    sent: int,
    lags: Sequence[float],
    stream_error: str | None,
    cpu_s: float,
) -> RunData:
    n = len(requests)
    arrival = np.array([r.arrival_ms for r in requests], dtype=float)
    first = np.full(n, math.nan)
    finish = np.full(n, math.nan)
    engine = np.full(n, -1, dtype=np.int64)
    cached = np.zeros(n, dtype=np.int64)
    workers: dict[int, int] = {}
    seen = sorted({t.worker for t in tracks.values() if t.worker is not None})
    for w in seen:
        workers[w] = len(workers)
    itl_v: list[float] = []
    itl_w: list[int] = []
    errors: list[str] = []
    for k, r in enumerate(requests):
        t = tracks[r.request_id]
        if t.error is not None:
            errors.append(f"{r.request_id}: {t.error}")
        if not math.isnan(t.first):
            first[k] = (t.first - start) * 1000.0
        if t.error is None and not math.isnan(t.finish):
            finish[k] = (t.finish - start) * 1000.0
        elif t.error is None and not math.isnan(t.sent_at):
            errors.append(f"{r.request_id}: unfinished when the stream ended (drain timeout or stream error)")
        if t.worker is not None:
            engine[k] = workers[t.worker]
        cached[k] = t.cached
        for gap, count in t.gaps:
            itl_v.append(gap * 1000.0)
            itl_w.append(count)
    if stream_error:
        errors.insert(0, f"stream: {stream_error}")
    return RunData(
        label=label or (options.router_mode or "live"),
        kind="live",
        arrival_ms=arrival,
        first_token_ms=first,
        finish_ms=finish,
        engine=engine,
        input_tokens=np.array([r.input_length for r in requests], dtype=np.int64),
        output_tokens=np.array([r.max_tokens for r in requests], dtype=np.int64),
        cached_tokens=cached,
        itl_ms=np.array(itl_v, dtype=float),
        itl_weight=np.array(itl_w, dtype=float),
        engines=max(len(workers), options.engines_hint),
        hit_source=HIT_SOURCE,
        errors=errors,
        meta={
            "frontend": options.frontend,
            "model": options.model,
            "router_mode": options.router_mode,
            "sent": sent,
            "send_lag_p50_ms": float(np.percentile(lags, 50)) * 1000.0 if lags else 0.0,
            "send_lag_p99_ms": float(np.percentile(lags, 99)) * 1000.0 if lags else 0.0,
            "max_send_lag_ms": max(lags, default=0.0) * 1000.0,
            "engine_ids": [f"{w:x}" for w in seen],
            "client_cpu_s": cpu_s,
        },
    )


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a declared dependency
        return None
    return tqdm(total=total, unit="req", desc="replay", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
