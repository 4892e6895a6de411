"""Frontend benchmark: what the frontend + router add on top of an engine, and how many streams/s they carry.

A real deployment on loopback: one ``kvmesh-worker`` (mocker engines at ``--speedup-ratio 0``, so an
engine answers as fast as it can compute), one ``kvmesh-router`` (``--router-mode kv``) and one
``kvmesh-frontend``, each its own process, on a private file-discovery directory. The client is this
process (grpc.aio on uvloop, kvmesh's own stubs). Two paths are measured in the same run:

- **direct**: the prompt's token ids on an engine, over one ``WorkerService.GenerateStream`` per
  worker shared by every request, as a frontend does (the baseline);
- **frontend**: ``ModelStreamInfer`` on the frontend with ``text_input`` (tokenize, hash, route,
  generate, detokenize, lifecycle): what a Triton client pays;
- **relay** (``--relay``, on by default): the floor of any Python gRPC hop. A bare grpc.aio relay in
  its own process (``python -m kvmesh_bench.frontend_bench --serve-relay``) takes the same KServe
  stream with ``input_ids``, sends it on its ``GenerateStream`` to an engine chosen round-robin and
  forwards each engine output as a KServe response: no tokenizer, no router, no detokenizer, no metrics.
  frontend minus relay is what kvmesh's own work costs; relay minus direct is the hop itself.

Phases (each path in turn, same prompts, ``ignore_eos`` so every request produces exactly
``--tokens`` tokens):

1. **latency**: one request at a time (``--requests`` after ``--warmup``); request time = send to
   the final response; p50/p99 per path and the difference (the latency the frontend + router add).
2. **throughput**: ``--concurrency`` client loops for ``--duration`` seconds, each loop on its own
   stream; streams/s = completed requests / elapsed.

Ratios are against the direct path measured in the same run (the machine is shared and noisy).
Run: ``python -m kvmesh_bench.frontend_bench --json out.json`` (or ``kvmesh bench frontend``).

**Paired A/B** (``--baseline-pythonpath PATHS``): instead of the table, two deployments run side by
side, the baseline's daemons importing first from ``PATHS`` (another checkout's ``services/*/src``),
and the client loads them alternately, round by round; it prints each daemon's CPU per request,
streams/s and one-at-a-time p50 for both, with the per-round ratios current/baseline. On a shared
machine this is the way to tell a 10 % change from noise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import uvloop
from inference import grpc_service_pb2 as kserve
from inference import grpc_service_pb2_grpc as kserve_grpc
from kvmesh.discovery import model_prefix, open_discovery
from kvmesh.ports import free_port
from kvmesh.v1 import discovery_pb2, worker_pb2, worker_pb2_grpc
from tokenizers import Tokenizer

from kvmesh_bench.argtypes import CommandParser, non_negative_int, output_file, positive_float, positive_int
from kvmesh_bench.local_procs import script
from kvmesh_bench.streams import drain, read_message
from kvmesh_bench.tables import write_json

NAMESPACE = "bench-frontend"
WORDS = [
    "kv", "cache", "routing", "prefix", "block", "engine", "token", "stream", "latency", "router", "worker",
    "frontend", "mesh", "decode", "prefill", "batch", "scheduler", "memory", "hash", "radix", "tree", "lease",
]  # fmt: skip


@dataclass
class PathStats:
    requests: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    ttft_p50_ms: float


@dataclass
class PathResult:
    latency: PathStats
    streams_per_s: float
    responses_per_request: float
    # CPU each process spent per request in the throughput phase, in milliseconds (robust to a
    # shared machine's noise, unlike the rates): {"worker": ..., "router": ..., "client": ...}
    cpu_ms_per_request: dict[str, float]


@dataclass
class Result:
    engines: int
    tokens: int
    prompt_tokens: int
    concurrency: int
    paths: dict[str, PathResult]
    added_p50_ms: float  # frontend - direct
    added_p99_ms: float
    latency_ratio_p50: float  # frontend / direct
    streams_ratio: float  # frontend / direct
    relay_added_p50_ms: float | None  # relay - direct (the hop alone)
    relay_streams_ratio: float | None


# -- the deployment ----------------------------------------------------------------------------
class Deployment:
    def __init__(self, workdir: Path, engines: int, block_size: int, pythonpath: str | None = None) -> None:
        self.workdir = workdir
        self.url = f"file://{workdir / 'discovery'}"
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self.engines = engines
        self.block_size = block_size
        self.frontend_port = free_port()
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if pythonpath:  # the daemons import these first (another checkout's services/*/src)
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")]))

    def _spawn(self, name: str, *args: str) -> None:
        log = self.workdir / f"{name}.log"
        common = ["--discovery", self.url, "--namespace", NAMESPACE, "--log-level", "warning"]
        with open(log, "wb") as out:
            proc = subprocess.Popen([script(name), *common, *args], stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=self.env)  # fmt: skip
        self.procs.append((name, proc, log))

    def start_relay(self, engines: list[tuple[int, str]]) -> int:
        port = free_port()
        log = self.workdir / "relay.log"
        targets = [f"{engine_id}@{address}" for engine_id, address in engines]
        command = [sys.executable, "-m", "kvmesh_bench.frontend_bench", "--serve-relay", str(port), *targets]
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(("relay", proc, log))
        return port

    def start(self) -> None:
        self._spawn("kvmesh-worker", "--grpc-port", "0", "--num-engines", str(self.engines), "--speedup-ratio", "0",
                    "--block-size", str(self.block_size), "--num-gpu-blocks", "65536")  # fmt: skip
        self._spawn("kvmesh-router", "--grpc-port", "0", "--router-mode", "kv")
        self._spawn("kvmesh-frontend", "--grpc-port", str(self.frontend_port))

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU of each daemon so far (Linux /proc; empty elsewhere)."""
        out: dict[str, float] = {}
        for name, proc, _log in self.procs:
            try:
                with open(f"/proc/{proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[name.removeprefix("kvmesh-")] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return out

    def check(self) -> None:
        for name, proc, log in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        for _name, proc, _log in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _name, proc, _log in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _wait_ready(stub: kserve_grpc.GRPCInferenceServiceAsyncStub, deployment: Deployment, model: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        deployment.check()
        with contextlib.suppress(grpc.aio.AioRpcError):
            if (await stub.ModelReady(kserve.ModelReadyRequest(name=model), timeout=1)).ready:
                config = (await stub.ModelConfig(kserve.ModelConfigRequest(name=model), timeout=1)).config
                if config.parameters["engines"].string_value == str(deployment.engines):
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError("the frontend did not become ready within 60 s")


async def _cards(url: str) -> list[discovery_pb2.ModelCard]:
    disc = await open_discovery(url)
    try:
        records = await disc.get_prefix(model_prefix(NAMESPACE))
    finally:
        await disc.close()
    return [discovery_pb2.ModelCard.FromString(value) for value in records.values()]


# -- requests ----------------------------------------------------------------------------------
def _prompts(count: int, words: int) -> list[str]:
    rng = np.random.default_rng(7)
    return [" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words)) + f" #{n}" for n in range(count)]


def kserve_request(model: str, prompt: str, tokens: int, request_id: str) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name=model, id=request_id)
    raw = []
    for name, value in (
        ("text_input", prompt.encode()),
        ("sampling_parameters", json.dumps({"max_tokens": tokens, "ignore_eos": True}).encode()),
    ):
        request.inputs.add(name=name, datatype="BYTES", shape=[1])
        raw.append(struct.pack("<I", len(value)) + value)
    for name in ("stream", "exclude_input_in_output"):
        request.inputs.add(name=name, datatype="BOOL", shape=[1])
        raw.append(b"\x01")
    request.raw_input_contents.extend(raw)
    return request


def _ids_request(model: str, token_ids: list[int], tokens: int, request_id: str) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="input_ids", datatype="INT32", shape=[len(token_ids)])
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    request.raw_input_contents.extend([np.asarray(token_ids, dtype="<i4").tobytes(), struct.pack("<i", tokens)])
    return request


class WorkerStream:
    """One ``GenerateStream`` to one worker, shared by concurrent requests (what a frontend keeps).

    A reader task hands each output to its request's queue; a request ends with its final output
    (a finish reason, or an in-band error, raised as RuntimeError).
    """

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceAsyncStub) -> None:
        self._stub = stub
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None  # held: the loop keeps only weak task references
        self._queues: dict[str, asyncio.Queue[worker_pb2.GenerateStreamOutput]] = {}

    async def generate(self, request: worker_pb2.GenerateRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        if self._call is None:
            self._call = self._stub.GenerateStream()
            self._reader = asyncio.ensure_future(self._read(self._call))
        queue = self._queues[request.request_id] = asyncio.Queue()
        try:
            await self._call.write(worker_pb2.GenerateStreamRequest(requests=[request]))
            while True:
                output = await queue.get()
                if output.error_code:
                    raise RuntimeError(f"{request.request_id}: {output.error_message}")
                yield output.response
                if output.response.finish_reason:
                    return
        finally:
            del self._queues[request.request_id]

    async def _read(self, call: Any) -> None:
        async for message in call:
            for output in message.outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)


class _Relay(kserve_grpc.GRPCInferenceServiceServicer):
    """The floor: KServe stream in, GenerateStream out, one KServe response per engine output, nothing else."""

    def __init__(self, targets: list[tuple[int, str]]) -> None:
        streams = {a: WorkerStream(worker_pb2_grpc.WorkerServiceStub(grpc.aio.insecure_channel(a))) for _, a in targets}
        self._targets = [(engine_id, streams[a]) for engine_id, a in targets]
        self._rr = itertools.count()

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> Any:
        async for request in request_iterator:
            token_ids = np.frombuffer(request.raw_input_contents[0], dtype="<i4").tolist()
            (max_tokens,) = struct.unpack("<i", request.raw_input_contents[1])
            engine_id, stream = self._targets[next(self._rr) % len(self._targets)]
            responses = stream.generate(worker_pb2.GenerateRequest(
                request_id=f"relay-{next(self._rr)}", engine_id=engine_id, token_ids=token_ids,
                sampling=worker_pb2.SamplingOptions(max_tokens=max_tokens, ignore_eos=True)))  # fmt: skip
            async for response in responses:
                message = kserve.ModelStreamInferResponse()
                out = message.infer_response
                out.id = request.id
                out.parameters["triton_final_response"].bool_param = bool(response.finish_reason)
                yield message


async def _serve_relay(port: int, targets: list[tuple[int, str]]) -> None:
    server = grpc.aio.server()
    # _Relay serves ModelStreamInfer only: the generated base class answers the other RPCs UNIMPLEMENTED at
    # runtime, while its .pyi declares every method abstract.
    kserve_grpc.add_GRPCInferenceServiceServicer_to_server(_Relay(targets), server)  # type: ignore[abstract]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


class FrontendClient:
    """One ModelStreamInfer stream; one request at a time on it (like one perf_analyzer context)."""

    def __init__(self, stub: kserve_grpc.GRPCInferenceServiceAsyncStub) -> None:
        self.call = stub.ModelStreamInfer()
        self.responses = 0

    async def run(self, request: kserve.ModelInferRequest) -> tuple[float, float]:
        start = time.perf_counter()
        first = 0.0
        await self.call.write(request)
        while True:
            message = await read_message(self.call, kserve.ModelStreamInferResponse, "the frontend")
            if message.error_message:
                raise RuntimeError(message.error_message)
            self.responses += 1
            if not first:
                first = time.perf_counter()
            if message.infer_response.parameters["triton_final_response"].bool_param:
                end = time.perf_counter()
                return end - start, first - start

    async def close(self) -> None:
        await self.call.done_writing()
        with contextlib.suppress(grpc.aio.AioRpcError):
            await drain(self.call)


class DirectClient:
    def __init__(self, cards: list[discovery_pb2.ModelCard], channels: dict[str, grpc.aio.Channel]) -> None:
        streams = {a: WorkerStream(worker_pb2_grpc.WorkerServiceStub(channel)) for a, channel in channels.items()}
        self.targets = [(c.engine_id, streams[c.address]) for c in cards]
        self._rr = itertools.count()
        self._ids = itertools.count()

    async def run(self, token_ids: list[int], tokens: int) -> tuple[float, float]:
        engine_id, stream = self.targets[next(self._rr) % len(self.targets)]
        request = worker_pb2.GenerateRequest(
            request_id=f"direct-{next(self._ids)}", engine_id=engine_id, token_ids=token_ids,
            sampling=worker_pb2.SamplingOptions(max_tokens=tokens, ignore_eos=True),
        )  # fmt: skip
        start = time.perf_counter()
        first = 0.0
        async for _response in stream.generate(request):
            if not first:
                first = time.perf_counter()
        return time.perf_counter() - start, first - start


def _stats(samples: list[tuple[float, float]]) -> PathStats:
    total = np.array([s[0] for s in samples]) * 1000
    ttft = np.array([s[1] for s in samples]) * 1000
    return PathStats(len(samples), float(np.percentile(total, 50)), float(np.percentile(total, 99)),
                     float(total.mean()), float(np.percentile(ttft, 50)))  # fmt: skip


async def _throughput(
    run_one: Any, concurrency: int, duration: float, deployment: Deployment | None = None
) -> tuple[float, dict[str, float]]:
    """(requests/s, CPU ms per request of each daemon and of this client)."""
    done = 0
    stop_at = time.perf_counter() + duration
    cpu_before = deployment.cpu_seconds() if deployment else {}
    client_before = time.process_time()

    async def loop(slot: int) -> None:
        nonlocal done
        n = 0
        while time.perf_counter() < stop_at:
            await run_one(slot, n)
            n += 1
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop(slot) for slot in range(concurrency)))
    rate = done / (time.perf_counter() - start)
    cpu_after = deployment.cpu_seconds() if deployment else {}
    cpu = {name: (cpu_after[name] - cpu_before.get(name, 0.0)) * 1000 / max(done, 1) for name in cpu_after}
    cpu["client"] = (time.process_time() - client_before) * 1000 / max(done, 1)
    return rate, cpu


async def _measure(args: argparse.Namespace, deployment: Deployment) -> Result:
    model = args.model
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{deployment.frontend_port}")
    stub = kserve_grpc.GRPCInferenceServiceStub(channel)
    await _wait_ready(stub, deployment, model)
    cards = [c for c in await _cards(deployment.url) if c.name == model]
    channels = {c.address: grpc.aio.insecure_channel(c.address) for c in cards}
    files_stub = worker_pb2_grpc.WorkerServiceStub(channels[cards[0].address])
    blob = b"".join([chunk.data async for chunk in files_stub.GetModelFile(
        worker_pb2.GetModelFileRequest(engine_id=cards[0].engine_id, name="tokenizer.json"))])  # fmt: skip
    tokenizer = Tokenizer.from_str(blob.decode())
    prompts = _prompts(args.warmup + args.requests + 4096, args.prompt_words)
    ids = [tokenizer.encode(p).ids for p in prompts]
    direct = DirectClient(cards, channels)
    tokens = args.tokens
    relay_channel = None
    if args.relay:
        relay_port = deployment.start_relay([(c.engine_id, c.address) for c in cards])
        relay_channel = grpc.aio.insecure_channel(f"127.0.0.1:{relay_port}")
        await asyncio.wait_for(relay_channel.channel_ready(), 30)
    relay_stub = kserve_grpc.GRPCInferenceServiceStub(relay_channel) if relay_channel else None

    # one runner per path: (stream client or None, run(client, prompt index, request id))
    def fe_run(client: FrontendClient, i: int, rid: str) -> Any:
        return client.run(kserve_request(model, prompts[i], tokens, rid))

    def relay_run(client: FrontendClient, i: int, rid: str) -> Any:
        return client.run(_ids_request(model, ids[i], tokens, rid))

    def direct_run(client: Any, i: int, rid: str) -> Any:
        return direct.run(ids[i], tokens)

    paths: dict[str, tuple[Any, Any]] = {"direct": (None, direct_run)}
    if relay_stub is not None:
        paths["relay"] = (relay_stub, relay_run)
    paths["frontend"] = (stub, fe_run)

    # latency: one request at a time, the paths interleaved so that noise hits them alike
    latency_clients = {name: FrontendClient(s) if s else None for name, (s, _run) in paths.items()}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    for i in range(args.warmup + args.requests):
        for name, (_stub, run) in paths.items():
            sample = await run(latency_clients[name], i, f"lat-{i}")
            if i >= args.warmup:
                samples[name].append(sample)
    for client in latency_clients.values():
        if client is not None:
            await client.close()

    # throughput: concurrency loops, each on its own stream
    offset = args.warmup + args.requests
    results: dict[str, PathResult] = {}
    for name, (path_stub, run) in paths.items():
        clients = [FrontendClient(path_stub) if path_stub else None for _ in range(args.concurrency)]

        async def one(slot: int, n: int, clients: list[Any] = clients, run: Any = run) -> None:
            await run(clients[slot], offset + (slot * 131 + n) % 4096, f"t{slot}-{n}")

        await _throughput(one, args.concurrency, min(1.0, args.duration))  # warm-up
        before = sum(c.responses for c in clients if c)
        rate, cpu = await _throughput(one, args.concurrency, args.duration, deployment)
        if name == "direct":
            cpu = {k: v for k, v in cpu.items() if k in ("worker", "client")}
        elif name == "relay":
            cpu = {k: v for k, v in cpu.items() if k in ("worker", "relay", "client")}
        else:
            cpu.pop("relay", None)
        responses = (sum(c.responses for c in clients if c) - before) / max(rate * args.duration, 1)
        for client in clients:
            if client is not None:
                await client.close()
        results[name] = PathResult(_stats(samples[name]), rate, responses if name != "direct" else 0.0, cpu)
    for ch in (channel, *channels.values(), *([relay_channel] if relay_channel else [])):
        await ch.close()
    d, f, r = results["direct"], results["frontend"], results.get("relay")
    return Result(
        engines=len(cards), tokens=tokens, prompt_tokens=int(np.mean([len(i) for i in ids])),
        concurrency=args.concurrency, paths=results,
        added_p50_ms=f.latency.p50_ms - d.latency.p50_ms, added_p99_ms=f.latency.p99_ms - d.latency.p99_ms,
        latency_ratio_p50=f.latency.p50_ms / d.latency.p50_ms, streams_ratio=f.streams_per_s / d.streams_per_s,
        relay_added_p50_ms=(r.latency.p50_ms - d.latency.p50_ms) if r else None,
        relay_streams_ratio=(r.streams_per_s / d.streams_per_s) if r else None,
    )  # fmt: skip


# -- paired A/B --------------------------------------------------------------------------------
async def _paired(args: argparse.Namespace, deployments: dict[str, Deployment]) -> dict[str, Any]:
    """Load two deployments alternately (round by round) and compare the CPU they spend per request.

    Each round, on each deployment in turn (the order alternates): ``--paired-latency`` requests one
    at a time, then ``--paired-requests`` requests at ``--concurrency``, the daemons' CPU read from
    /proc around the latter. The first round warms up and is not counted. Pairing the rounds cancels
    most of a shared machine's drift; the per-round ratios show what is left.
    """
    model = args.model
    stubs = {}
    channels = []
    for name, deployment in deployments.items():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{deployment.frontend_port}")
        channels.append(channel)
        stubs[name] = kserve_grpc.GRPCInferenceServiceStub(channel)
        await _wait_ready(stubs[name], deployment, model)
    prompts = _prompts(4096, args.prompt_words)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in deployments}
    names = list(deployments)
    for index in range(args.rounds + 1):
        for name in names if index % 2 == 0 else names[::-1]:
            deployment, stub = deployments[name], stubs[name]
            client = FrontendClient(stub)
            latency = [(await client.run(kserve_request(model, prompts[i], args.tokens, f"l{index}-{i}")))[0]
                       for i in range(args.paired_latency)]  # fmt: skip
            await client.close()
            clients = [FrontendClient(stub) for _ in range(args.concurrency)]
            ids = itertools.count()

            async def loop(
                slot: int, clients: list[FrontendClient] = clients, ids: Any = ids, index: int = index
            ) -> None:
                while (i := next(ids)) < args.paired_requests:
                    request = kserve_request(model, prompts[i % len(prompts)], args.tokens, f"r{index}-{i}")
                    await clients[slot].run(request)

            before, start = deployment.cpu_seconds(), time.perf_counter()
            await asyncio.gather(*(loop(slot) for slot in range(args.concurrency)))
            elapsed, after = time.perf_counter() - start, deployment.cpu_seconds()
            for c in clients:
                await c.close()
            if index == 0:
                continue
            sample = {k: (after[k] - before.get(k, 0.0)) * 1000 / args.paired_requests for k in after}
            sample["all"] = sum(sample.values())
            sample["streams_per_s"] = args.paired_requests / elapsed
            sample["p50_ms"] = float(np.percentile(np.array(latency) * 1000, 50))
            rounds[name].append(sample)
    for channel in channels:
        await channel.close()
    keys = list(rounds[names[0]][0])
    median = {name: {k: float(np.median([r[k] for r in rounds[name]])) for k in keys} for name in names}
    ratios = {
        k: [b[k] / a[k] for a, b in zip(rounds["baseline"], rounds["current"], strict=True) if a[k]] for k in keys
    }
    return {"rounds": rounds, "median": median, "ratio_median": {k: float(np.median(v)) for k, v in ratios.items()},
            "ratios": ratios}  # fmt: skip


def _paired_table(out: dict[str, Any], args: argparse.Namespace) -> str:
    labels = {
        "worker": "CPU ms/request: worker",
        "router": "CPU ms/request: router",
        "frontend": "CPU ms/request: frontend",
        "all": "CPU ms/request: all daemons",
        "streams_per_s": f"streams/s @ c={args.concurrency}",
        "p50_ms": "request p50 (ms), one at a time",
    }
    rows = [("", "baseline", "current", "current/baseline (median of rounds)", "per round")]
    for key, label in labels.items():
        if key not in out["median"]["current"]:
            continue
        rows.append((label, f"{out['median']['baseline'][key]:.3f}", f"{out['median']['current'][key]:.3f}",
                     f"{out['ratio_median'][key]:.3f}", " ".join(f"{x:.2f}" for x in out["ratios"][key])))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    header = (
        f"paired A/B: {args.rounds} rounds, each {args.paired_latency} requests one at a time + "
        f"{args.paired_requests} at c={args.concurrency}; baseline PYTHONPATH={args.baseline_pythonpath}"
    )
    return header + "\n" + "\n".join(lines)


def _table(r: Result) -> str:
    names = list(r.paths)
    d = r.paths["direct"].latency

    def row(label: str, values: list[str]) -> tuple[str, ...]:
        return (label, *values)

    def lat(attr: str) -> list[str]:
        out = []
        for name in names:
            value = getattr(r.paths[name].latency, attr)
            base = getattr(d, attr)
            out.append(f"{value:.3f}" if name == "direct" else f"{value:.3f} (+{value - base:.3f})")
        return out

    titles = {"direct": "direct GenerateStream", "relay": "bare relay", "frontend": "frontend+router"}
    base_rate = r.paths["direct"].streams_per_s
    rows = [
        row("", [titles[n] for n in names]),
        row("request p50 (ms)", lat("p50_ms")),
        row("request p99 (ms)", lat("p99_ms")),
        row("request mean (ms)", lat("mean_ms")),
        row("first response p50 (ms)", lat("ttft_p50_ms")),
        row(f"streams/s @ c={r.concurrency}", [
            f"{r.paths[n].streams_per_s:.0f}"
            + ("" if n == "direct" else f" ({r.paths[n].streams_per_s / base_rate:.2f}x)")
            for n in names]),
        row("KServe responses/request", ["-" if n == "direct" else f"{r.paths[n].responses_per_request:.1f}"
                                         for n in names]),
    ]  # fmt: skip
    for proc in ("worker", "router", "relay", "frontend", "client"):
        if any(proc in r.paths[n].cpu_ms_per_request for n in names):
            rows.append(row(f"CPU ms/request: {proc}", [
                f"{r.paths[n].cpu_ms_per_request[proc]:.2f}" if proc in r.paths[n].cpu_ms_per_request else "-"
                for n in names]))  # fmt: skip
    # The CPU every process of the path spends per request, and the streams/s that cost allows on
    # this machine's cores with nothing else running: the throughput figure a shared machine's noise
    # does not move much (the measured streams/s depend on what else runs).
    totals = {n: sum(r.paths[n].cpu_ms_per_request.values()) for n in names}
    cores = os.cpu_count() or 1
    rows.append(row("CPU ms/request: all processes", [f"{totals[n]:.2f}" for n in names]))
    rows.append(row(f"CPU-bound streams/s on {cores} cores", [
        f"{cores * 1000 / totals[n]:.0f}" if totals[n] > 0 else "-" for n in names]))  # fmt: skip
    widths = [max(len(cells[i]) for cells in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(cells)) for cells in rows]
    lines.insert(1, "-" * len(lines[0]))
    header = (f"frontend bench: {r.engines} mocker engine(s) at speedup 0, {r.prompt_tokens}-token prompts, "
              f"{r.tokens} tokens/request; latency: one request at a time; streams/s: c={r.concurrency}")  # fmt: skip
    footer = (
        f"frontend adds p50 {r.added_p50_ms:+.3f} ms ({r.latency_ratio_p50:.2f}x direct), "
        f"streams/s {r.streams_ratio:.2f}x direct"
    )
    if r.relay_added_p50_ms is not None:
        footer += f"; a bare relay hop alone adds {r.relay_added_p50_ms:+.3f} ms, {r.relay_streams_ratio:.2f}x"
    return header + "\n" + "\n".join(lines) + "\n" + footer


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(prog="kvmesh bench frontend", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--engines", type=positive_int, default=2, help="mocker engines in the worker process")
    parser.add_argument("--model", default="kvmesh-mock", help="model served by the worker")
    parser.add_argument("--tokens", type=positive_int, default=16, help="tokens generated per request")
    parser.add_argument("--prompt-words", type=positive_int, default=48, help="words per prompt")
    parser.add_argument("--block-size", type=positive_int, default=16, help="engine KV block size")
    parser.add_argument("--requests", type=positive_int, default=300, help="sequential requests per path (latency)")
    parser.add_argument("--warmup", type=non_negative_int, default=50, help="sequential warm-up requests per path")
    parser.add_argument("--concurrency", type=positive_int, default=64, help="client loops in the throughput phase")
    parser.add_argument("--duration", type=positive_float, default=8.0, help="seconds per path in the throughput phase")
    parser.add_argument("--json", type=output_file, default=None, metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--keep-logs", type=Path, default=None, metavar="DIR", help="keep daemon logs here")
    parser.add_argument("--relay", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure a bare grpc.aio relay (the floor of one Python hop)")  # fmt: skip
    parser.add_argument("--serve-relay", nargs="+", default=None, metavar="ARG", help=argparse.SUPPRESS)
    parser.add_argument("--baseline-pythonpath", default=None, metavar="PATHS",
                        help="paired A/B instead of the table: a second deployment whose daemons import from these "
                             "paths first (e.g. another checkout's services/*/src, colon-separated), loaded "
                             "alternately with the current one; prints CPU per request and the ratios")  # fmt: skip
    parser.add_argument("--rounds", type=positive_int, default=6, help="paired A/B: counted rounds (plus one warm-up)")
    parser.add_argument(
        "--paired-requests", type=positive_int, default=1500, help="paired A/B: requests per round at c"
    )
    parser.add_argument(
        "--paired-latency", type=positive_int, default=100, help="paired A/B: one-at-a-time requests per round"
    )
    args = parser.parse_args(argv)
    if args.serve_relay:  # internal: PORT ENGINE_ID@ADDRESS ...
        port, *targets = args.serve_relay
        parsed = [(int(t.split("@", 1)[0]), t.split("@", 1)[1]) for t in targets]
        uvloop.run(_serve_relay(int(port), parsed))
        return 0

    if args.baseline_pythonpath:
        return _run_paired(args)
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-fe-bench-"))
    deployment = Deployment(workdir, args.engines, args.block_size)
    deployment.start()
    try:
        result = uvloop.run(_measure(args, deployment))
    except Exception as exc:
        print(f"frontend bench failed: {exc}", file=sys.stderr)
        for name, _proc, log in deployment.procs:
            print(f"--- {name}\n{log.read_text()[-2000:]}", file=sys.stderr)
        return 1
    finally:
        deployment.stop()
        if args.keep_logs is not None:
            shutil.copytree(workdir, args.keep_logs, dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print(_table(result))
    if args.json is not None:
        write_json(args.json, asdict(result))
    return 0


def _run_paired(args: argparse.Namespace) -> int:
    workdirs = {name: Path(tempfile.mkdtemp(prefix=f"kvmesh-fe-bench-{name}-")) for name in ("baseline", "current")}
    deployments = {
        "baseline": Deployment(workdirs["baseline"], args.engines, args.block_size, args.baseline_pythonpath),
        "current": Deployment(workdirs["current"], args.engines, args.block_size),
    }
    try:
        for deployment in deployments.values():
            deployment.start()
        out = uvloop.run(_paired(args, deployments))
    except Exception as exc:
        print(f"frontend bench failed: {exc}", file=sys.stderr)
        for deployment in deployments.values():
            for name, _proc, log in deployment.procs:
                print(f"--- {name}\n{log.read_text()[-2000:]}", file=sys.stderr)
        return 1
    finally:
        for deployment in deployments.values():
            deployment.stop()
        for workdir in workdirs.values():
            shutil.rmtree(workdir, ignore_errors=True)
    print(_paired_table(out, args))
    if args.json is not None:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
