"""Stream intervals: a request's tokens leave the worker in chunks, by vLLM's rule, for any engine.

The rule (``GenerateStreamSession``, vLLM's ``stream_interval``): the first token goes out at once, then
the tokens go out whenever at least ``interval`` of them are new, and the rest with the request's end.
The interval is the larger of the request's ``SamplingOptions.stream_interval`` and the worker's
``--stream-interval``. A real worker (mocker engine, one pass every few ms at ``--speedup-ratio 1``, so a
pass's tokens would each be their own message without an interval) over real gRPC.
"""

from __future__ import annotations

import itertools

import grpc
import pytest
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from kvmesh_worker.engine import RequestOutput
from kvmesh_worker.generate_stream import _Hold

from tests.support.daemons import file_worker
from tests.support.generate import StreamClient, engine_ids

WORKER_INTERVAL = 3


def output(total: int, new: int = 1, *, finished: bool = False, error: str | None = None) -> RequestOutput:
    return RequestOutput("r", tuple(range(new)), total, finished, "length" if finished else None, error_code=error)


def test_the_first_token_goes_at_once_then_every_interval_then_the_end() -> None:
    hold = _Hold(4)
    assert hold.take(output(0, 0)) is None  # a pass that produced no token yet (a prefill chunk)
    first = hold.take(output(1))
    assert first is not None and [o.num_output_tokens for o in first] == [0, 1]
    assert [hold.take(output(n)) for n in (2, 3, 4)] == [None, None, None]
    released = hold.take(output(5))
    assert released is not None and [o.num_output_tokens for o in released] == [2, 3, 4, 5]
    assert hold.take(output(7, 2)) is None
    released = hold.take(output(10, 3))  # a pass of several tokens crosses the interval
    assert released is not None and [o.num_output_tokens for o in released] == [7, 10]
    released = hold.take(output(11, finished=True))
    assert released is not None and [o.num_output_tokens for o in released] == [11]


def test_an_error_releases_what_was_held_with_it() -> None:
    hold = _Hold(8)
    assert hold.take(output(1)) is not None
    assert hold.take(output(2)) is None
    released = hold.take(output(2, 0, finished=True, error="UNAVAILABLE"))
    assert released is not None and [o.error_code for o in released] == [None, "UNAVAILABLE"]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    flags = ["--drain-timeout", "1", "--block-size", "4", "--num-gpu-blocks", "256", "--speedup-ratio", "1",
             "--stream-interval", str(WORKER_INTERVAL)]  # fmt: skip
    with file_worker(tmp_path_factory.mktemp("interval"), "interval", *flags) as daemon:
        yield daemon


@pytest.fixture
async def client(worker):
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        (engine,) = await engine_ids(stub)
        stream = StreamClient(stub)
        try:
            yield engine, stream
        finally:
            await stream.close()


_ids = itertools.count()


def request(engine: int, max_tokens: int, **sampling: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=f"s{next(_ids)}",
        engine_id=engine,
        token_ids=list(range(5, 25)),
        sampling=worker_pb2.SamplingOptions(max_tokens=max_tokens, ignore_eos=True, **sampling),
    )


def chunks(stream: StreamClient, request_id: str) -> list[int]:
    return [len(o.response.token_ids) for o in stream.outputs[request_id]]


async def test_requests_stream_in_chunks_of_their_interval_never_below_the_workers(client) -> None:
    engine, stream = client
    default, wider = request(engine, 23), request(engine, 23, stream_interval=5)
    below = request(engine, 23, stream_interval=2)  # cannot go below the worker's 3
    await stream.send([default, wider, below])
    await stream.wait_final(default.request_id, wider.request_id, below.request_id)
    for req, interval in ((default, WORKER_INTERVAL), (wider, 5), (below, WORKER_INTERVAL)):
        sizes = chunks(stream, req.request_id)
        assert sum(sizes) == 23
        assert sizes[0] == 1, sizes  # the first token at once: TTFT is not traded for fewer messages
        assert all(size >= interval for size in sizes[1:-1]), (interval, sizes)
        assert stream.final(req.request_id).response.finish_reason == worker_pb2.FINISH_REASON_LENGTH


async def test_held_tokens_keep_their_logprobs(client) -> None:
    engine, stream = client
    req = request(engine, 14, stream_interval=4, logprobs=1)
    await stream.send([req])
    await stream.wait_final(req.request_id)
    for o in stream.outputs[req.request_id]:
        assert len(o.response.logprobs) == len(o.response.token_ids)
        assert all(len(step.top) == 1 for step in o.response.logprobs)


async def test_a_cancelled_request_sends_nothing_it_held(client) -> None:
    engine, stream = client
    req = request(engine, 200, stream_interval=50)
    await stream.send([req])
    await stream.wait_first(req.request_id)
    await stream.send(cancel=[req.request_id])
    settled = len(stream.outputs[req.request_id])
    probe = request(engine, 60)  # long enough for the cancelled request's next chunk to be due
    await stream.send([probe])
    await stream.wait_final(probe.request_id)
    assert len(stream.outputs[req.request_id]) == settled
    assert stream.final(req.request_id) is None
