"""``kvmesh bench vllm-overhead``: vLLM behind kvmesh against the same vLLM driven directly, one run.

    .venv-vllm/bin/kvmesh bench vllm-overhead --requests 48 --concurrency 8 --json overhead.json

Same requests (seeded random token ids), same engine arguments, same machine, one after the other:

1. **direct**: an in-process ``AsyncLLM`` (token ids in, ``detokenize=False``, DELTA), driven by
   ``--concurrency`` closed-loop clients; TTFT = ``generate`` called → first delta;
2. **mesh**: ``kvmesh-worker --engine vllm`` + ``kvmesh-router`` + ``kvmesh-frontend`` (file
   discovery), the same closed loop over one KServe ``ModelStreamInfer`` (input_ids, stream=true),
   as tritonclient's ``start_stream`` does; TTFT = request written → first streamed response. The
   requests name ``output_ids`` as their output (``--mesh-output ids``), so the mesh, like the direct
   run, returns token ids and detokenizes nothing; ``--mesh-output text`` adds the frontend's
   detokenization (KServe's default ``text_output``), which the direct run does not do.

In both modes, once the engine is up, the processes other than vLLM's model runner (this one, the
engine's scheduler, the mesh's daemons) move off the model's cores, as ``kvmesh up`` does
(``kvmesh_cli.vllm_cores``); ``--share-model-cores`` leaves every process everywhere, in both modes.

``--stream-interval N`` (default 1) has both modes stream in chunks, vLLM's ``stream_interval``: the
direct run's ``SamplingParams`` and the mesh's ``sampling_parameters`` carry it (first token at once, then
at least N tokens per output).

Throughput is output tokens per second of wall time over the whole closed loop. Reported: each
mode's figures, the mesh/direct throughput ratio (goal ≥ 0.95) and the added TTFT p50 (goal < 2 ms).
On a shared 2-core machine one pair moves by ±15 % from one run to the next, so ``--rounds N``
measures N pairs in one run, alternating which mode goes first, and reports the median of the
per-round ratios and added TTFTs (each round compares two runs taken minutes apart, no more).
Needs the vLLM venv (``make setup-vllm``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from kvmesh_cli.vllm_cores import confine, keep_off_model_cores

from kvmesh_bench.argtypes import CommandParser, non_negative_int, output_file, positive_int, tcp_port
from kvmesh_bench.tables import format_table, write_json

if TYPE_CHECKING:
    from inference import grpc_service_pb2 as kserve

ALL_CORES = frozenset(os.sched_getaffinity(0))  # as this process started
TINY_LLAMA = Path(__file__).resolve().parents[3] / "services/worker/src/kvmesh_worker/models/tiny-llama"


def _requests(n: int, isl: int, seed: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(10, vocab, isl)] for _ in range(n)]


def _summary(mode: str, ttfts: list[float], tokens: int, wall: float) -> dict[str, Any]:
    arr = np.array(ttfts) * 1000.0
    return {
        "mode": mode,
        "requests": len(ttfts),
        "tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": tokens / wall,
        "ttft_p50_ms": float(np.percentile(arr, 50)),
        "ttft_p99_ms": float(np.percentile(arr, 99)),
    }


async def _closed_loop(prompts: list[list[int]], concurrency: int, one: Any) -> tuple[list[float], int, float]:
    queue = list(enumerate(prompts))
    ttfts: list[float] = [0.0] * len(prompts)
    total = 0

    async def client() -> None:
        nonlocal total
        while queue:
            i, prompt = queue.pop(0)
            ttft, n = await one(prompt)
            ttfts[i] = ttft
            total += n

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return ttfts, total, time.monotonic() - start


def _keep_off_model_cores(args: argparse.Namespace, pids: list[int]) -> None:
    if not args.share_model_cores:
        keep_off_model_cores([os.getpid(), *pids])


def _unconfine() -> None:
    """This process back on every core, so that the next engine picks its cores from all of them."""
    confine(os.getpid(), ALL_CORES)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "block_size": args.block_size,
        "enforce_eager": True,
        "seed": 0,
        "load_format": "dummy",
        **json.loads(args.vllm_engine_args),
    }


def direct_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The direct run's ``SamplingParams`` fields (besides DELTA outputs): what the mesh's requests ask for."""
    return {
        "max_tokens": args.osl,
        "ignore_eos": True,
        "detokenize": False,
        "temperature": 0,
        "stream_interval": args.stream_interval if args.stream_interval > 1 else None,
    }


def mesh_request(request_id: str, prompt: list[int], args: argparse.Namespace, model: str) -> kserve.ModelInferRequest:
    """The mesh's KServe request for one prompt: the direct run's work (``direct_sampling``), as a client sends it."""
    from kvmesh_bench.replay.live import build_infer_request

    extra = {"stream_interval": args.stream_interval} if args.stream_interval > 1 else None
    request = build_infer_request(request_id, np.asarray(prompt), args.osl, model, sampling=extra)
    ask_for_outputs(request, args.mesh_output)
    return request


async def run_direct(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from kvmesh_worker.engines.vllm.amx import request_amx_permission
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    request_amx_permission()
    with _ipc_directory():
        llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=str(args.model_path), skip_tokenizer_init=True, enable_prefix_caching=True, **engine_kwargs(args)
            )
        )
        params = SamplingParams(output_kind=RequestOutputKind.DELTA, **direct_sampling(args))

        async def one(prompt: list[int]) -> tuple[float, int]:
            start = time.monotonic()
            first = None
            n = 0
            async for out in llm.generate({"prompt_token_ids": prompt}, params, uuid.uuid4().hex):
                got = len(out.outputs[0].token_ids)
                if got and first is None:
                    first = time.monotonic() - start
                n += got
            return first or 0.0, n

        try:
            _keep_off_model_cores(args, [])
            await one(prompts[0][:16])  # warm-up
            ttfts, tokens, wall = await _closed_loop(prompts, args.concurrency, one)
        finally:
            llm.shutdown()
            _unconfine()
    return _summary("direct AsyncLLM", ttfts, tokens, wall)


@contextlib.contextmanager
def _ipc_directory() -> Iterator[None]:
    """vLLM's ZMQ IPC sockets (seven per engine) stay in the temp dir even after a clean stop: give them
    a directory of ours, removed after the run (the worker does the same for its engine)."""
    previous = os.environ.get("VLLM_RPC_BASE_PATH")
    scratch = tempfile.mkdtemp(prefix="kvmesh-overhead-ipc-")
    os.environ["VLLM_RPC_BASE_PATH"] = scratch
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = previous
        shutil.rmtree(scratch, ignore_errors=True)


def _spawn(name: str, argv: list[str], log_dir: Path) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).parent / name
    log = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child's for its lifetime
    # One session with the client and the direct engine (a process group of its own, not a session):
    # in sessions of their own (Linux autogroup) the mesh measured 1.2-2.3x slower (docs/benchmarks.md).
    return subprocess.Popen(
        [str(exe), *argv], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, process_group=0
    )


def ask_for_outputs(request: kserve.ModelInferRequest, mesh_output: str) -> None:
    """``ids``: name ``output_ids`` and ``num_output_tokens`` as the request's outputs, so the frontend
    returns token ids and detokenizes nothing, as the direct run does (``detokenize=False``); ``text``:
    leave the outputs unnamed, so the frontend also detokenizes every token into ``text_output`` (its
    KServe default), work the direct run does not do."""
    if mesh_output == "text":
        return
    request.inputs.add(name="return_output_ids", datatype="BOOL", shape=[1])
    request.raw_input_contents.append(b"\x01")
    for name in ("output_ids", "num_output_tokens"):
        request.outputs.add(name=name)


async def run_mesh(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    import grpc
    from inference import grpc_service_pb2_grpc as kserve_grpc
    from kvmesh_cli.kserve_demo import server_ready

    from kvmesh_bench.replay.live import _num_tokens, build_infer_request

    log_dir = Path(tempfile.mkdtemp(prefix="kvmesh-overhead-"))  # removed after a run that went well
    keep_logs = True
    common = ["--discovery", f"file://{log_dir / 'discovery'}", "--namespace", "overhead"]
    port = args.grpc_port
    procs = [
        _spawn(
            "kvmesh-worker",
            [
                *common,
                "--engine",
                "vllm",
                "--model-path",
                str(args.model_path),
                "--block-size",
                str(args.block_size),
                "--vllm-engine-args",
                json.dumps(engine_kwargs(args)),
            ],
            log_dir,
        ),
        _spawn("kvmesh-router", common, log_dir),
        _spawn("kvmesh-frontend", [*common, "--grpc-port", str(port)], log_dir),
    ]
    try:
        deadline = time.monotonic() + 300
        while not server_ready(f"127.0.0.1:{port}"):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the mesh did not come up")
            await asyncio.sleep(0.5)
        _keep_off_model_cores(args, [p.pid for p in procs])
        model = Path(args.model_path).name
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)

        async def one(prompt: list[int]) -> tuple[float, int]:
            call = stub.ModelStreamInfer(timeout=600)
            start = time.monotonic()
            await call.write(build_infer_request(uuid.uuid4().hex, np.asarray(prompt), args.osl, model))
            await call.done_writing()
            first = None
            n = 0
            async for reply in call:
                if reply.error_message:
                    raise RuntimeError(reply.error_message)
                got = _num_tokens(reply.infer_response)
                if got and first is None:
                    first = time.monotonic() - start
                n += got
            return first or 0.0, n

        for _ in range(20):  # the router may still be warming up for a moment after ServerReady
            try:
                await one(prompts[0][:16])
                break
            except (grpc.aio.AioRpcError, RuntimeError):
                await asyncio.sleep(0.5)
        # One ModelStreamInfer for every request, as tritonclient's start_stream + async_stream_infer.
        shared = stub.ModelStreamInfer(timeout=3600)
        waiting: dict[str, asyncio.Queue[int]] = {}
        write_lock = asyncio.Lock()  # one write in flight per gRPC call

        async def demux() -> None:
            async for reply in shared:
                if reply.error_message:
                    raise RuntimeError(reply.error_message)
                response = reply.infer_response
                got = _num_tokens(response)
                final = response.parameters.get("triton_final_response")
                queue = waiting[response.id]
                if got:
                    queue.put_nowait(got)
                if final is not None and final.bool_param:
                    queue.put_nowait(-1)

        reader = asyncio.get_running_loop().create_task(demux())

        async def one_shared(prompt: list[int]) -> tuple[float, int]:
            rid = uuid.uuid4().hex
            queue = waiting[rid] = asyncio.Queue()
            start = time.monotonic()
            request = mesh_request(rid, prompt, args, model)
            async with write_lock:
                await shared.write(request)
            first = None
            n = 0
            while (got := await queue.get()) != -1:
                if first is None:
                    first = time.monotonic() - start
                n += got
            del waiting[rid]
            return first or 0.0, n

        ttfts, tokens, wall = await _closed_loop(prompts, args.concurrency, one_shared)
        await shared.done_writing()
        reader.cancel()
        await channel.close()
    except BaseException:
        print(f"kvmesh bench vllm-overhead: the mesh's logs are in {log_dir}", file=sys.stderr)
        raise
    else:
        keep_logs = False
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        _unconfine()
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
    return _summary("kvmesh (KServe→frontend→router→worker)", ttfts, tokens, wall)


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="kvmesh bench vllm-overhead", description=__doc__)
    p.add_argument("--model-path", default=str(TINY_LLAMA), help="HF model dir (default: the repo's tiny-llama)")
    p.add_argument("--vllm-engine-args", default="{}", help="extra vLLM engine arguments (JSON), both modes")
    p.add_argument("--block-size", type=positive_int, default=32)
    p.add_argument("--requests", type=positive_int, default=48)
    p.add_argument("--concurrency", type=positive_int, default=8)
    p.add_argument("--isl", type=positive_int, default=256, help="prompt tokens per request (distinct prompts)")
    p.add_argument("--osl", type=positive_int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--vocab-size", type=positive_int, default=2000)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--grpc-port", type=tcp_port, default=18041, help="the mesh's frontend port")
    p.add_argument(
        "--share-model-cores",
        action="store_true",
        help="leave every process on every core (default: off the model's cores once the engine is up)",
    )
    p.add_argument(
        "--mesh-output",
        choices=("ids", "text"),
        default="ids",
        help="ids (default): the mesh returns token ids, as the direct run does; text: it also detokenizes",
    )
    p.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="vLLM's stream_interval in both modes: tokens per streamed output after the first (default 1: every step)",
    )
    p.add_argument("--rounds", type=positive_int, default=1, help="direct/mesh pairs to measure (medians reported)")
    p.add_argument("--json", type=output_file, metavar="PATH")
    return p


def compare(direct: dict[str, Any], mesh: dict[str, Any]) -> dict[str, Any]:
    """One round: both modes' figures, the mesh/direct throughput ratio and the added TTFT p50."""
    return {
        "direct": direct,
        "mesh": mesh,
        "throughput_ratio": mesh["throughput_tok_s"] / direct["throughput_tok_s"],
        "added_ttft_p50_ms": mesh["ttft_p50_ms"] - direct["ttft_p50_ms"],
    }


def summarize_rounds(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The medians over rounds of each round's own ratio and added TTFT (never a ratio of medians:
    a round's two runs share the machine's state of that moment, different rounds do not)."""
    ratios = [r["throughput_ratio"] for r in rounds]
    return {
        "throughput_ratio": statistics.median(ratios),
        "added_ttft_p50_ms": statistics.median(r["added_ttft_p50_ms"] for r in rounds),
        "throughput_ratio_range": [min(ratios), max(ratios)],
        "rounds": list(rounds),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts = _requests(args.requests, args.isl, args.seed, args.vocab_size)
    rounds = []
    for n in range(args.rounds):
        if n % 2 == 0:  # alternate which mode runs first, so that neither always gets the fresher machine
            direct = asyncio.run(run_direct(args, prompts))
            mesh = asyncio.run(run_mesh(args, prompts))
        else:
            mesh = asyncio.run(run_mesh(args, prompts))
            direct = asyncio.run(run_direct(args, prompts))
        rounds.append(compare(direct, mesh))
    columns = [
        ("round", "round", "{}"),
        ("mode", "mode", "{}"),
        ("throughput_tok_s", "tok/s", "{:.0f}"),
        ("ttft_p50_ms", "TTFT p50 ms", "{:.2f}"),
        ("ttft_p99_ms", "TTFT p99 ms", "{:.2f}"),
        ("wall_s", "wall s", "{:.1f}"),
    ]
    rows = [{**r[mode], "round": n + 1} for n, r in enumerate(rounds) for mode in ("direct", "mesh")]
    print(format_table(rows, columns))
    summary = summarize_rounds(rounds)
    for n, r in enumerate(rounds):
        print(f"round {n + 1}: ratio {r['throughput_ratio']:.3f}, added TTFT p50 {r['added_ttft_p50_ms']:+.2f} ms")
    print(
        f"\nthroughput ratio mesh/direct: {summary['throughput_ratio']:.3f} (goal >= 0.95); added TTFT p50: "
        f"{summary['added_ttft_p50_ms']:+.2f} ms (goal < 2 ms)"
        + (f"; medians of {len(rounds)} rounds" if len(rounds) > 1 else "")
    )
    if args.json:
        write_json(args.json, {**summary, "mesh_output": args.mesh_output, "stream_interval": args.stream_interval})
    return 0
