"""``kvmesh profile``: measure a running engine and write the mocker's interpolated perf model (NPZ).

    kvmesh profile --engine-address 127.0.0.1:50051 --out vllm-cpu.npz --json profile.json
    kvmesh profile --frontend 127.0.0.1:8001 --model tiny-llama --out vllm-cpu.npz

Any engine kind works (vLLM, the mocker, an engine behind a whole mesh): the client only sends token
ids and times the streamed tokens. ``--engine-address`` talks to a worker's ``GenerateStream``
directly (the cleanest figures: no routing); ``--frontend`` goes through KServe.

- **Prefill:** for each ISL, a fresh random prompt with ``max_tokens=2``; TTFT = send → first token
  (median of ``--repeats`` x ``--rounds`` samples). With ``--cached`` fractions, the same prompt's
  first part is warmed first, to show TTFT against cached tokens (reported; the NPZ keys prefill on
  uncached tokens, which is what the mocker's ``prefill_ms`` takes).
- **Decode:** for each batch size B and context C, B concurrent fresh prompts of C tokens. ITL is
  timed only in the window where all B are decoding (from the last first token to the first last
  token), median over requests: the early requests' first tokens come while the others still
  prefill, and counting those mixed passes made a batch of 8 x 1024 tokens look up to 1.8x slower
  than its decode passes are. Each request asks for ``--decode-tokens`` plus one token per 512
  prompt tokens of the batch (a conservative prefill budget per pass), so the window keeps about
  ``--decode-tokens`` passes.

The NPZ is what ``kvmesh-worker --perf-model PATH`` reads (``InterpolatedPerfModel``):
``prefill_isl`` → ``prefill_ttft_ms``; ``decode_itl[active_kv_tokens, context]`` on the grid of
``B × C'`` active KV tokens by ``C'``, the window's mean context (each context column interpolated
over its measured batch sizes).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import grpc
import numpy as np

from kvmesh_bench.argtypes import CommandParser, fractions, non_negative_int, output_file, positive_int, positive_ints
from kvmesh_bench.tables import format_table, write_json

_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class ProfileFailed(Exception):
    """The engine (or frontend) refused a measuring request: the profile cannot be taken."""


def engine_id(text: str) -> int:
    """An engine id as ``kvmesh status`` shows it (hex) or as a number (``0x2a``, ``42``)."""
    try:
        return int(text, 16) if not text.startswith(("0x", "0X")) and not text.isdigit() else int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an engine id (hex, or 0x.., or decimal), got {text!r}") from None


class Client:
    """Sends prompts, returns each request's token arrival times (monotonic seconds) from its send."""

    async def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[tuple[float, int]]]:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class EngineClient(Client):
    """A worker's ``GenerateStream``, one stream per batch (as a frontend multiplexes them)."""

    def __init__(self, address: str, engine_id: int | None) -> None:
        from kvmesh.v1 import worker_pb2, worker_pb2_grpc

        self._pb = worker_pb2
        self._channel = grpc.aio.insecure_channel(address, options=_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        self._engine_id = engine_id

    async def engine_id(self) -> int:
        if self._engine_id is None:
            call = self._stub.WatchLoad(self._pb.WatchLoadRequest(), timeout=10)
            async for message in call:
                self._engine_id = int(message.loads[0].engine_id)
                break
            call.cancel()
        assert self._engine_id is not None
        return self._engine_id

    async def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[tuple[float, int]]]:
        pb = self._pb
        engine_id = await self.engine_id()
        ids = [f"p-{uuid.uuid4().hex[:12]}" for _ in prompts]
        sampling = pb.SamplingOptions(max_tokens=max_tokens, ignore_eos=True)
        message = pb.GenerateStreamRequest(
            requests=[
                pb.GenerateRequest(request_id=rid, engine_id=engine_id, token_ids=p, sampling=sampling)
                for rid, p in zip(ids, prompts, strict=True)
            ]
        )
        times: dict[str, list[tuple[float, int]]] = {rid: [] for rid in ids}
        call = self._stub.GenerateStream(timeout=600)
        start = time.monotonic()
        await call.write(message)
        await call.done_writing()
        async for reply in call:
            now = time.monotonic() - start
            for output in reply.outputs:
                if output.error_code:
                    raise ProfileFailed(f"{output.request_id}: {output.error_message}")
                if output.response.token_ids:
                    times[output.request_id].append((now, len(output.response.token_ids)))
        return [times[rid] for rid in ids]

    async def close(self) -> None:
        await self._channel.close()


class FrontendClient(Client):
    """KServe ``ModelStreamInfer`` (input_ids, stream=true), one stream per batch."""

    def __init__(self, address: str, model: str) -> None:
        from inference import grpc_service_pb2_grpc as kserve_grpc

        self._channel = grpc.aio.insecure_channel(address, options=_OPTIONS)
        self._stub = kserve_grpc.GRPCInferenceServiceStub(self._channel)
        self._model = model

    async def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[tuple[float, int]]]:
        from kvmesh_bench.replay.live import _num_tokens, build_infer_request

        ids = [f"p-{uuid.uuid4().hex[:12]}" for _ in prompts]
        times: dict[str, list[tuple[float, int]]] = {rid: [] for rid in ids}
        call = self._stub.ModelStreamInfer(timeout=600)
        start = time.monotonic()
        for rid, prompt in zip(ids, prompts, strict=True):
            await call.write(build_infer_request(rid, np.asarray(prompt), max_tokens, self._model))
        pending = set(ids)
        async for reply in call:
            now = time.monotonic() - start
            if reply.error_message:
                raise ProfileFailed(reply.error_message)
            response = reply.infer_response
            n = _num_tokens(response)
            if n:
                times[response.id].append((now, n))
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                pending.discard(response.id)
                if not pending:
                    break
        await call.done_writing()
        call.cancel()
        return [times[rid] for rid in ids]

    async def close(self) -> None:
        await self._channel.close()


@dataclass
class PrefillPoint:
    isl: int
    cached: int
    ttft_ms: float


@dataclass
class DecodePoint:
    batch: int
    context: int
    itl_ms: float
    active_kv_tokens: float
    mean_context: float


#: Prompt tokens one pass is assumed to prefill at least, to size the decode requests' lead-in.
_PREFILL_TOKENS_PER_PASS = 512


def decode_window(results: list[list[tuple[float, int]]], context: int) -> tuple[list[float], float | None]:
    """Per-request ITL (ms) while all requests of a batch decode together, and that window's mean context.

    ``results`` holds each request's ``(seconds since send, tokens in that response)``. The window runs
    from the last request's first token to the first request's last one; a request contributes the gaps
    between its responses inside it. Empty results: the batch never decoded all at once.
    """
    start = max(times[0][0] for times in results)
    end = min(times[-1][0] for times in results)
    itls: list[float] = []
    contexts: list[float] = []
    for times in results:
        before = 0  # tokens of this request up to and including its first response in the window
        inside: list[tuple[float, int]] = []
        for t, n in times:
            if t < start:
                before += n
            elif t <= end:
                inside.append((t, n))
        if len(inside) < 2:
            continue
        before += inside[0][1]
        gaps = sum(n for _, n in inside[1:])
        itls.append((inside[-1][0] - inside[0][0]) * 1000.0 / gaps)
        contexts.append(context + before + gaps / 2)
    return itls, (statistics.fmean(contexts) if contexts else None)


async def profile(client: Client, args: argparse.Namespace) -> tuple[list[PrefillPoint], list[DecodePoint]]:
    """Sweep every point ``--rounds`` times, one whole sweep after another; each point is the median of
    all its samples, so a slow minute on a shared machine moves one round of a point, not the point."""
    rng = np.random.default_rng(args.seed)

    def fresh(n: int) -> list[int]:
        return [int(x) for x in rng.integers(10, args.vocab_size, n)]

    await client.run([fresh(8)], 2)  # warm-up: connections, first-pass costs
    prefill_points = [
        (isl, int(isl * fraction) // args.block_size * args.block_size)
        for isl in args.isl
        for fraction in args.cached
        if not fraction or int(isl * fraction) >= args.block_size  # under one block: the uncached point
    ]
    decode_points = [(batch, context) for context in args.context for batch in args.batch]
    ttfts: dict[tuple[int, int], list[float]] = {point: [] for point in prefill_points}
    itls: dict[tuple[int, int], list[float]] = {point: [] for point in decode_points}
    contexts: dict[tuple[int, int], list[float]] = {point: [] for point in decode_points}
    d = args.decode_tokens
    for round_ in range(1, args.rounds + 1):
        for isl, cached in prefill_points:
            for _ in range(args.repeats):
                prompt = fresh(isl)
                if cached:
                    await client.run([prompt[:cached]], 1)  # warm the prefix
                (times,) = await client.run([prompt], 2)
                ttfts[isl, cached].append(times[0][0] * 1000.0)
        for batch, context in decode_points:
            lead = -(-batch * context // _PREFILL_TOKENS_PER_PASS)  # passes until the last one prefilled
            for _ in range(args.repeats):
                results = await client.run([fresh(context) for _ in range(batch)], d + lead)
                window, mean = decode_window(results, context)
                itls[batch, context] += window
                contexts[batch, context] += [mean] if mean is not None else []
        print(f"round {round_} of {args.rounds} done", file=sys.stderr)
    prefill = [PrefillPoint(isl, cached, statistics.median(ttfts[isl, cached])) for isl, cached in prefill_points]
    for point in prefill:
        print(f"prefill isl={point.isl} cached={point.cached}: {point.ttft_ms:.2f} ms", file=sys.stderr)
    decode: list[DecodePoint] = []
    for batch, context in decode_points:
        if not itls[batch, context]:
            raise SystemExit(
                f"kvmesh profile: batch {batch} x context {context} never decoded all at once; raise --decode-tokens"
            )
        mean_ctx = round(statistics.fmean(contexts[batch, context]))
        decode.append(DecodePoint(batch, context, statistics.median(itls[batch, context]), batch * mean_ctx, mean_ctx))
        print(f"decode batch={batch} context={context}: {decode[-1].itl_ms:.2f} ms", file=sys.stderr)
    return prefill, decode


def path_overhead_ms(prefill: list[PrefillPoint], decode: list[DecodePoint]) -> float:
    """The request path's fixed cost in a TTFT: the shortest uncached prompt's TTFT minus one decode pass
    of the smallest batch and context (a short prefill pass costs about what a small decode pass does on
    a real engine; not on the mocker's polynomial model, whose prefill has a 16.5 ms constant)."""
    shortest = min((p for p in prefill if p.cached == 0), key=lambda p: p.isl)
    smallest = min(decode, key=lambda p: (p.context, p.batch))
    return max(0.0, shortest.ttft_ms - smallest.itl_ms)


def perf_model_arrays(
    prefill: list[PrefillPoint], decode: list[DecodePoint], net_prefill: bool = False
) -> dict[str, np.ndarray]:
    """The NPZ arrays ``InterpolatedPerfModel`` reads; ``net_prefill`` takes :func:`path_overhead_ms` off
    every prefill point (the mocker then models the prefill pass, and its own live path adds the rest)."""
    overhead = path_overhead_ms(prefill, decode) if net_prefill else 0.0
    uncached = sorted({p.isl: max(0.0, p.ttft_ms - overhead) for p in prefill if p.cached == 0}.items())
    # One column per prompt length; its context is the mean over its batch sizes' decode windows.
    prompt_lengths = sorted({p.context for p in decode})
    contexts = [statistics.fmean(p.mean_context for p in decode if p.context == c) for c in prompt_lengths]
    kv_axis = sorted({p.active_kv_tokens for p in decode})
    itl = np.zeros((len(kv_axis), len(contexts)))
    for j, prompt_length in enumerate(prompt_lengths):
        column = sorted((p.active_kv_tokens, p.itl_ms) for p in decode if p.context == prompt_length)
        xs, ys = [c[0] for c in column], [c[1] for c in column]
        itl[:, j] = np.interp(kv_axis, xs, ys)
    return {
        "prefill_isl": np.array([k for k, _ in uncached], dtype=float),
        "prefill_ttft_ms": np.array([v for _, v in uncached], dtype=float),
        "decode_active_kv_tokens": np.array(kv_axis, dtype=float),
        "decode_context_length": np.array(contexts, dtype=float),
        "decode_itl": itl,
    }


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="kvmesh profile", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--engine-address", metavar="HOST:PORT", help="a worker's WorkerService (GenerateStream)")
    where.add_argument("--frontend", metavar="HOST:PORT", help="a frontend's KServe gRPC address")
    p.add_argument("--engine-id", type=engine_id, default=None, help="engine of the worker (default: its first)")
    p.add_argument("--model", default="kvmesh-mock", help="--frontend: the model name")
    p.add_argument("--isl", type=positive_ints, default="32,64,128,256,512,1024", help="prefill ISLs")
    p.add_argument("--cached", type=fractions, default="0,0.5", help="cached fractions of the ISL (0 = none)")
    p.add_argument("--batch", type=positive_ints, default="1,2,4,8", help="decode batch sizes")
    p.add_argument("--context", type=positive_ints, default="64,256,1024", help="decode prompt lengths")
    p.add_argument("--decode-tokens", type=positive_int, default=32, help="tokens per decode request")
    p.add_argument("--repeats", type=positive_int, default=3, help="samples per point in each round")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="whole sweeps, one after another; a point is the median of all its samples",
    )
    p.add_argument(
        "--block-size", type=positive_int, default=32, help="the engine's block size (cached prefixes align to it)"
    )
    p.add_argument("--vocab-size", type=positive_int, default=2000, help="token ids drawn below it")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--out", type=output_file, metavar="NPZ", required=True, help="where the mocker's perf model goes")
    p.add_argument(
        "--net-prefill",
        action="store_true",
        help="take the request path's fixed cost (shortest prompt's TTFT minus a batch-1 decode pass) off every "
        "prefill point: for a profile taken through a mesh, since the mocker's live mesh pays that path again",
    )
    p.add_argument("--json", type=output_file, metavar="PATH", help="write every measured point as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if 0.0 not in args.cached:
        args.cached = [0.0, *args.cached]

    async def go() -> tuple[list[PrefillPoint], list[DecodePoint]]:
        client: Client = (
            EngineClient(args.engine_address, args.engine_id)
            if args.engine_address
            else FrontendClient(args.frontend, args.model)
        )
        try:
            return await profile(client, args)
        finally:
            await client.close()

    try:
        prefill, decode = asyncio.run(go())
    except grpc.aio.AioRpcError as exc:
        target = args.engine_address or args.frontend
        print(f"kvmesh profile: error: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    except ProfileFailed as exc:  # a request refused (an engine the worker does not host, say)
        print(f"kvmesh profile: error: {exc}", file=sys.stderr)
        return 2
    arrays = perf_model_arrays(prefill, decode, args.net_prefill)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "wb") as out:
        np.savez(out, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
    print("prefill (TTFT against ISL and cached tokens)")
    print(format_table([asdict(p) for p in prefill], [("isl", "ISL", "{}"), ("cached", "cached", "{}"),
                                                       ("ttft_ms", "TTFT ms", "{:.2f}")]))  # fmt: skip
    print("\ndecode (ITL against batch size and context)")
    columns = [("batch", "batch", "{}"), ("context", "context", "{}"), ("itl_ms", "ITL ms", "{:.2f}"),
               ("active_kv_tokens", "active KV tokens", "{:.0f}")]  # fmt: skip
    print(format_table([asdict(p) for p in decode], columns))
    print(f"request path's fixed cost in a TTFT: {path_overhead_ms(prefill, decode):.2f} ms"
          f" ({'taken off' if args.net_prefill else 'kept in'} the prefill points)")  # fmt: skip
    print(f"perf model written to {args.out} (kvmesh-worker --perf-model {args.out})")
    if args.json:
        write_json(
            args.json,
            {
                "prefill": [asdict(p) for p in prefill],
                "decode": [asdict(p) for p in decode],
                "path_overhead_ms": path_overhead_ms(prefill, decode),
                "net_prefill": args.net_prefill,
            },
        )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile", help="measure a running engine; write the mocker's perf model (NPZ)", add_help=False
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: main(a.args), benchmark="profile")
