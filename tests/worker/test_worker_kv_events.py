"""A real ``kvmesh-worker`` process: its KV event stream over gRPC resumes with no gap and no duplicate.

- Resume from an id still in the replay buffer: the missed events, then live ones, ids contiguous
  and identical to what an uninterrupted subscriber saw.
- Resume from an id older than the buffer (``--event-buffer-size``): a snapshot, then live events;
  the index rebuilt from them equals the engine's own (DumpKvIndex), also after more live events.
- A start id beyond the next event id is OUT_OF_RANGE.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import grpc
import pytest
from kvmesh.v1 import kv_events_pb2, worker_pb2, worker_pb2_grpc

from tests.support.daemons import file_worker
from tests.support.generate import engine_ids
from tests.support.generate import generate as generate_on_stream

pytestmark = pytest.mark.e2e

BUFFER = 24
BLOCK = 4


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    flags = [
        "--num-gpu-blocks", "32",  # small: eviction (BlocksRemoved) happens too
        "--block-size", str(BLOCK),
        "--event-buffer-size", str(BUFFER),
        "--speedup-ratio", "0",
    ]  # fmt: skip
    with file_worker(tmp_path_factory.mktemp("kv-events"), "kvev", *flags) as daemon:
        yield daemon


@pytest.fixture
async def stub(worker):
    async with grpc.aio.insecure_channel(worker.address) as channel:
        yield worker_pb2_grpc.WorkerServiceStub(channel)


_rids = itertools.count()


async def generate(stub, engine: int, count: int, rng: random.Random) -> None:
    """``count`` requests, one after the other; shared prefixes give cache hits, the small cache evictions."""
    for _ in range(count):
        prefix = [7, 8, 9, 10] * rng.randint(0, 2)
        prompt = prefix + [rng.randrange(3, 2048) for _ in range(rng.randint(5, 14))]
        request = worker_pb2.GenerateRequest(
            request_id=f"kv{next(_rids)}",
            engine_id=engine,
            token_ids=prompt,
            sampling=worker_pb2.SamplingOptions(max_tokens=rng.randint(3, 9), ignore_eos=True),
        )
        await generate_on_stream(stub, request, timeout=20)


async def next_event_id(stub, engine: int) -> int:
    dump = await stub.DumpKvIndex(worker_pb2.DumpKvIndexRequest(engine_id=engine), timeout=5)
    return dump.snapshot.next_event_id


class Subscriber:
    """Reads one SubscribeKvEvents stream in the background, keeping every message."""

    def __init__(self, stub, engine: int, start: int | None) -> None:
        request = worker_pb2.SubscribeKvEventsRequest(engine_id=engine)
        if start is not None:
            request.start_event_id = start
        self.call = stub.SubscribeKvEvents(request)
        self.snapshot: kv_events_pb2.KvIndexSnapshot | None = None
        self.events: list[kv_events_pb2.KvEvent] = []
        self.first_kind: str | None = None
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for message in self.call:
            kind = message.WhichOneof("item")
            if self.first_kind is None:
                self.first_kind = kind
            if kind == "snapshot":
                assert self.snapshot is None, "a second snapshot"
                self.snapshot = message.snapshot
            else:
                self.events.extend(message.events.events)

    @property
    def ids(self) -> list[int]:
        return [e.event_id for e in self.events]

    async def wait_until(self, next_id: int, timeout: float = 15.0) -> None:
        """Until the stream has delivered everything before ``next_id``."""
        async with asyncio.timeout(timeout):
            while True:
                if self.task.done():
                    self.task.result()  # re-raise the stream's error
                    raise AssertionError("stream ended")
                covered = self.events[-1].event_id + 1 if self.events else None
                if covered is None and self.snapshot is not None:
                    covered = self.snapshot.next_event_id
                if covered is not None and covered >= next_id:
                    return
                await asyncio.sleep(0.01)

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    def index(self) -> set[int]:
        """The cached set rebuilt from the snapshot (if any) and the events."""
        blocks: set[int] = set()
        if self.snapshot is not None:
            for stored in self.snapshot.stored:
                blocks.update(stored.block_hashes)
        for event in self.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                blocks.update(event.stored.block_hashes)
            elif kind == "removed":
                blocks.difference_update(event.removed.block_hashes)
            else:
                blocks.clear()
        return blocks


async def engine_index(stub, engine: int) -> tuple[set[int], int]:
    dump = await stub.DumpKvIndex(worker_pb2.DumpKvIndexRequest(engine_id=engine), timeout=5)
    return {h for stored in dump.snapshot.stored for h in stored.block_hashes}, dump.snapshot.next_event_id


async def test_resume_from_the_buffer_has_no_gap_and_no_duplicate(stub):
    rng = random.Random(1)
    (engine,) = await engine_ids(stub)
    base = await next_event_id(stub, engine)
    full = Subscriber(stub, engine, base)  # uninterrupted: the reference
    cut = Subscriber(stub, engine, base)
    subscribers = [full, cut]
    try:
        await generate(stub, engine, 3, rng)
        first_end = await next_event_id(stub, engine)
        assert first_end - base >= 4, "the first batch produced too few events to test a resume"
        await cut.wait_until(first_end)
        await cut.close()
        assert cut.ids == list(range(base, first_end))

        await generate(stub, engine, 2, rng)  # while disconnected
        end = await next_event_id(stub, engine)
        k = base + (first_end - base) // 2  # resume from an event the cut subscriber had already seen
        assert end - k <= BUFFER, "the second batch overflowed the buffer; make it smaller"
        resumed = Subscriber(stub, engine, k)
        subscribers.append(resumed)
        await resumed.wait_until(end)
        await generate(stub, engine, 1, rng)  # and live events keep following
        end = await next_event_id(stub, engine)
        await resumed.wait_until(end)
        await full.wait_until(end)

        assert resumed.first_kind == "events" and resumed.snapshot is None
        assert resumed.ids == list(range(k, end))
        assert full.ids == list(range(base, end))
        assert resumed.events == full.events[k - base :]
        assert cut.events == full.events[: first_end - base]
    finally:
        for sub in subscribers:
            await sub.close()


async def test_resume_from_before_the_buffer_gets_a_snapshot_then_live_events(stub):
    rng = random.Random(2)
    (engine,) = await engine_ids(stub)
    old = await next_event_id(stub, engine)
    reference = Subscriber(stub, engine, None)  # snapshot + live from now on, never interrupted
    subscribers = [reference]
    try:
        while await next_event_id(stub, engine) < old + BUFFER + 8:  # push `old` out of the buffer
            await generate(stub, engine, 2, rng)
        stale = Subscriber(stub, engine, old)
        subscribers.append(stale)
        expected, end = await engine_index(stub, engine)
        await stale.wait_until(end)
        assert stale.first_kind == "snapshot"
        assert stale.snapshot.next_event_id == end
        assert stale.index() == expected

        await generate(stub, engine, 4, rng)  # live events after the snapshot
        expected, end = await engine_index(stub, engine)
        await stale.wait_until(end)
        await reference.wait_until(end)
        live_from = stale.snapshot.next_event_id
        assert stale.ids == list(range(live_from, end))  # no gap, no duplicate
        assert stale.index() == expected
        assert reference.index() == expected
        assert stale.events == [e for e in reference.events if e.event_id >= live_from]
        assert any(e.WhichOneof("data") == "removed" for e in reference.events), "no eviction was exercised"
    finally:
        for sub in subscribers:
            await sub.close()


async def test_start_at_next_event_id_streams_only_new_events(stub):
    (engine,) = await engine_ids(stub)
    start = await next_event_id(stub, engine)
    sub = Subscriber(stub, engine, start)
    try:
        await generate(stub, engine, 1, random.Random(3))
        end = await next_event_id(stub, engine)
        await sub.wait_until(end)
        assert sub.first_kind == "events" and sub.ids == list(range(start, end))
    finally:
        await sub.close()


async def test_start_after_next_event_id_is_out_of_range(stub):
    (engine,) = await engine_ids(stub)
    beyond = await next_event_id(stub, engine) + 1
    call = stub.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest(engine_id=engine, start_event_id=beyond))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call.read()
    assert error.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert str(beyond) in error.value.details()


async def test_unknown_engine_is_not_found(stub):
    call = stub.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest(engine_id=12345))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call.read()
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.DumpKvIndex(worker_pb2.DumpKvIndexRequest(engine_id=12345))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
