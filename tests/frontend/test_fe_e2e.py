"""Real daemons (worker, router, frontend subprocesses), checked with kvmesh's own stubs.

What the stock-client tests cannot see without our stubs: the engine's own view (WatchLoad) and its
own tokens (a direct GenerateStream request with the same prompt and seed must produce what the frontend relayed).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from kvmesh.discovery import model_prefix, open_discovery
from kvmesh.v1 import discovery_pb2, worker_pb2, worker_pb2_grpc
from kvmesh_frontend.tensors import output_values

from tests.frontend.frontend_fakes import bool_input, bytes_input, ids_input, llm_request
from tests.support.daemons import Daemon
from tests.support.etcd import free_port
from tests.support.generate import generate, tokens_of

pytestmark = pytest.mark.e2e
MODEL = "kvmesh-mock"


class Deployment:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.url = f"file://{tmp / 'discovery'}"
        self.ns = f"fe{uuid.uuid4().hex[:8]}"
        self.daemons: list[Daemon] = []

    def start(self, name: str, *args: str) -> Daemon:
        port = free_port()
        common = ["--discovery", self.url, "--namespace", self.ns, "--grpc-port", str(port), "--lease-ttl", "2"]
        daemon = Daemon(name, [*common, *args], self.tmp, port)
        self.daemons.append(daemon)
        # a frontend is SERVING only once it knows a router and an engine: some tests start it before them
        return daemon.wait_started() if name == "kvmesh-frontend" else daemon.wait_serving()

    def close(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.close()

    async def card(self) -> discovery_pb2.ModelCard:
        disc = await open_discovery(self.url)
        try:
            records = await disc.get_prefix(model_prefix(self.ns))
        finally:
            await disc.close()
        return discovery_pb2.ModelCard.FromString(next(iter(records.values())))


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[tuple[Deployment, Daemon, Daemon]]:
    for module in ("kvmesh_worker.main", "kvmesh_router.main"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not available")
    dep = Deployment(tmp_path)
    try:
        worker = dep.start("kvmesh-worker", "--speedup-ratio", "1", "--block-size", "16", "--num-gpu-blocks", "4096")
        dep.start("kvmesh-router", "--router-mode", "kv")
        frontend = dep.start("kvmesh-frontend")
        yield dep, worker, frontend
    finally:
        dep.close()


async def wait_ready(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    for _ in range(200):
        if (await stub.ModelReady(pb.ModelReadyRequest(name=MODEL))).ready:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("model not ready")


async def test_frontend_relays_the_engines_tokens_exactly(deployment) -> None:
    dep, worker, frontend = deployment
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await wait_ready(stub)
        prompt = list(range(100, 164))
        request = llm_request(None, model=MODEL, sampling={"max_tokens": 24, "seed": 42, "ignore_eos": True},
                              extra=[ids_input(prompt), bool_input("return_output_ids", True)])  # fmt: skip
        request.outputs.add(name="output_ids")
        via_frontend = output_values(await stub.ModelInfer(request), "output_ids")
    card = await dep.card()
    async with grpc.aio.insecure_channel(worker.address) as channel:
        direct = tokens_of(await generate(worker_pb2_grpc.WorkerServiceStub(channel), worker_pb2.GenerateRequest(
            request_id="direct", engine_id=card.engine_id, token_ids=prompt,
            sampling=worker_pb2.SamplingOptions(max_tokens=24, seed=42, ignore_eos=True))))  # fmt: skip
    assert via_frontend == direct and len(direct) == 24


async def test_the_eos_that_stops_the_engine_is_left_out_of_the_text_as_vllm_does(deployment) -> None:
    """With skip_special_tokens false, the EOS that ended the output came out as "</s>"; vLLM leaves out the
    text of whichever token stopped the engine (EOS or a stop token id), as with stop_token_ids here."""
    import numpy as np
    from kvmesh_worker.engine.generation import generation_key, sample_tokens

    dep, _, frontend = deployment
    card = await dep.card()
    prompt = [10, 11, 12]
    key = lambda seed: generation_key(np.array(prompt, np.uint32), seed)  # noqa: E731
    seed = next(s for s in range(100_000) if list(sample_tokens(key(s), 0, 3, card.vocab_size))[2:] == [2]
                and 2 not in sample_tokens(key(s), 0, 2, card.vocab_size))  # fmt: skip
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await wait_ready(stub)
        texts = []
        for stop_ids in ([], [2]):
            sampling = {"max_tokens": 6, "seed": seed, "skip_special_tokens": False, "stop_token_ids": stop_ids}
            request = llm_request(None, model=MODEL, sampling=sampling,
                                  extra=[ids_input(prompt), bool_input("return_output_ids", True)])  # fmt: skip
            request.outputs.add(name="text_output")
            request.outputs.add(name="output_ids")
            reply = await stub.ModelInfer(request)
            assert output_values(reply, "output_ids")[-1] == 2  # the EOS id stays in output_ids
            texts.append(output_values(reply, "text_output")[0])
    assert texts[0] == texts[1] and b"</s>" not in texts[0], texts


async def test_chat_request_with_the_models_own_template(deployment) -> None:
    _, _, frontend = deployment
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await wait_ready(stub)
        messages = [{"role": "user", "content": "Héllo — 日本"}]
        request = llm_request(None, model=MODEL, sampling={"max_tokens": 8, "ignore_eos": True},
                              extra=[bytes_input("messages", json.dumps(messages)),
                                     bool_input("return_num_output_tokens", True)])  # fmt: skip
        request.outputs.add(name="num_output_tokens")
        response = await stub.ModelInfer(request)
        assert output_values(response, "num_output_tokens") == [8]


async def test_cancel_returns_the_engines_blocks_within_a_second(deployment) -> None:
    _, worker, frontend = deployment
    loop = asyncio.get_running_loop()
    async with (
        grpc.aio.insecure_channel(frontend.address) as fe_channel,
        grpc.aio.insecure_channel(worker.address) as worker_channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(fe_channel)
        await wait_ready(stub)
        watch = worker_pb2_grpc.WorkerServiceStub(worker_channel).WatchLoad(worker_pb2.WatchLoadRequest())
        load = {}

        async def follow() -> None:
            async for message in watch:
                for engine in message.loads:
                    load[engine.engine_id] = (engine.active_blocks, engine.running, loop.time())

        follower = asyncio.create_task(follow())
        while not load:
            await asyncio.sleep(0.01)
        before = sum(v[0] for v in load.values())
        call = stub.ModelStreamInfer()
        await call.write(llm_request(" ".join(["long prompt"] * 150), model=MODEL, stream=True,
                                     sampling={"max_tokens": 5000, "ignore_eos": True}))  # fmt: skip
        for _ in range(5):
            assert not (await call.read()).error_message
        busy_deadline = loop.time() + 5
        while sum(v[0] for v in load.values()) <= before:  # load updates are coalesced by the worker
            assert loop.time() < busy_deadline, "the engine never showed the request's blocks"
            await asyncio.sleep(0.01)
        cancelled_at = loop.time()
        call.cancel()
        while sum(v[0] for v in load.values()) != before or any(v[1] for v in load.values()):
            assert loop.time() - cancelled_at < 1.0, f"blocks still held 1 s after the cancel: {load}"
            await asyncio.sleep(0.01)
        follower.cancel()


async def test_nothing_is_ready_while_no_router_replica_is_registered(tmp_path: Path) -> None:
    """A worker serves the model, but no router: every request would fail UNAVAILABLE, so ServerReady and
    ModelReady say false (a client polling readiness must not start too early); a router makes them true."""
    dep = Deployment(tmp_path)
    try:
        dep.start("kvmesh-worker", "--block-size", "16")
        frontend = dep.start("kvmesh-frontend")
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for _ in range(200):  # the frontend has seen the model (it describes it) but has no router
                try:
                    await stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL))
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("the frontend never saw the model")
            assert not (await stub.ServerReady(pb.ServerReadyRequest())).ready
            assert not (await stub.ModelReady(pb.ModelReadyRequest(name=MODEL))).ready
            dep.start("kvmesh-router")
            await wait_ready(stub)
            assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
    finally:
        dep.close()


async def test_sigterm_ends_an_idle_stream_instead_of_waiting_out_the_drain_timeout(tmp_path: Path) -> None:
    """A KServe client that keeps a ModelStreamInfer stream open between requests (tritonclient's
    start_stream) held a SIGTERM'd frontend for its whole drain timeout (30 s in a soak audit)."""
    dep = Deployment(tmp_path)
    try:
        frontend = dep.start("kvmesh-frontend", "--drain-timeout", "30")
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
            await call.write(llm_request("x", model="nope", request_id="open", stream=True))
            answer = await asyncio.wait_for(call.read(), 10)
            assert answer.error_message.startswith("NOT_FOUND")  # answered in band: the stream stays open
            started = time.monotonic()
            frontend.signal(signal.SIGTERM)
            assert await asyncio.to_thread(frontend.wait, 20) == 0
            assert time.monotonic() - started < 5
            assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF
    finally:
        dep.close()


async def test_a_dead_router_is_unavailable_to_clients_without_its_address_or_grpcs_diagnostics(
    deployment: tuple[Deployment, Daemon, Daemon],
) -> None:
    """The only router replica killed before its lease expires: the client is told UNAVAILABLE, retryable,
    and nothing of the mesh's insides (the replica's address, gRPC's connect error): those go to the log."""
    dep, _, frontend = deployment
    router = next(d for d in dep.daemons if d.name == "kvmesh-router")
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await wait_ready(stub)
        await stub.ModelInfer(llm_request("hello", model=MODEL, sampling={"max_tokens": 2}), timeout=30)
        router.signal(signal.SIGKILL)
        router.wait()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ModelInfer(llm_request("hello", model=MODEL, sampling={"max_tokens": 2}), timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details() == "no router replica could route the request (1 tried)"
    frontend.wait_log(rf"router session to \w+ at 127\.0\.0\.1:{router.port} broke")


async def test_a_silent_router_is_unavailable_to_clients_without_its_address(
    deployment: tuple[Deployment, Daemon, Daemon],
) -> None:
    """A router replica that stops answering (frozen, partitioned): the client was told its address."""
    dep, _, _ = deployment
    router = next(d for d in dep.daemons if d.name == "kvmesh-router")
    frontend = dep.start("kvmesh-frontend", "--route-timeout", "1")  # before keepalive notices the silence
    async with grpc.aio.insecure_channel(frontend.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await wait_ready(stub)
        router.signal(signal.SIGSTOP)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ModelInfer(llm_request("hello", model=MODEL, sampling={"max_tokens": 2}), timeout=60)
        finally:
            router.signal(signal.SIGCONT)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details().startswith("no router replica gave a decision within")
    assert str(router.port) not in refused.value.details()
    frontend.wait_log(rf"no decision from router replica \w+ at 127\.0\.0\.1:{router.port}")
