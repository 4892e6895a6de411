"""A stock-tritonclient load for the multi-host tests: open loop, one ModelStreamInfer stream per request.

Requests alternate between the given frontends (each request's *client frontend*); every one is
recorded with its frontend, its start and end (monotonic), its outcome (``ok`` or the error text) and
the engine that served it (the final response's ``kvmesh.worker_id``).
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient

MODEL = "kvmesh-mock"


@dataclass
class Result:
    frontend: str
    started: float
    ended: float
    status: str  # "ok" or the error
    engine_id: int = 0


def _bytes(name: str, value: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
    return tensor


def _bool(name: str, value: bool) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([value], dtype=bool))
    return tensor


def one_request(frontend: str, request_id: str, tokens: int, prompt: str, timeout: float = 60.0) -> Result:
    started = time.monotonic()
    results: queue.Queue[tuple[object, object]] = queue.Queue()
    inputs = [_bytes("text_input", prompt), _bool("stream", True), _bool("exclude_input_in_output", True),
              _bytes("sampling_parameters", json.dumps({"ignore_eos": True, "max_tokens": tokens}))]  # fmt: skip
    try:
        with grpcclient.InferenceServerClient(frontend) as client:
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            try:
                client.async_stream_infer(model_name=MODEL, inputs=inputs, request_id=request_id)
                deadline = started + timeout
                while True:
                    result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
                    if error is not None:
                        return Result(frontend, started, time.monotonic(), str(error)[:300])
                    response = result.get_response()  # type: ignore[attr-defined]
                    if response.parameters["triton_final_response"].bool_param:
                        engine = response.parameters["kvmesh.worker_id"].int64_param
                        return Result(frontend, started, time.monotonic(), "ok", engine)
            finally:
                client.stop_stream()
    except queue.Empty:
        return Result(frontend, started, time.monotonic(), f"no final response within {timeout:g} s")
    except Exception as exc:  # a client-side failure is a failed request too
        return Result(frontend, started, time.monotonic(), f"{type(exc).__name__}: {exc}"[:300])


class Load:
    """``rate`` requests/s spread over ``frontends`` until :meth:`stop`; :attr:`results` once stopped."""

    def __init__(self, frontends: list[str], rate: float = 4.0, tokens: int = 24) -> None:
        self.frontends = frontends
        self.rate = rate
        self.tokens = tokens
        self.results: list[Result] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=64)
        self._futures: list[object] = []
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        start = time.monotonic()
        fronts = itertools.cycle(self.frontends)
        for n in itertools.count():
            if self._stop.is_set():
                return
            prompt = f"multihost {n} " + " ".join(("kv", "cache", "mesh", "lease")[(n * 7 + i) % 4] for i in range(24))
            self._futures.append(self._pool.submit(one_request, next(fronts), f"mh{n}", self.tokens, prompt))
            time.sleep(max(0.0, start + (n + 1) / self.rate - time.monotonic()))

    def finished(self) -> list[Result]:
        """The results of the requests that have ended so far, while the load goes on."""
        return [f.result() for f in list(self._futures) if f.done()]  # type: ignore[attr-defined]

    def stop(self) -> list[Result]:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self._pool.shutdown(wait=True)
            self.results = [f.result() for f in self._futures]  # type: ignore[attr-defined]
        return self.results

    def failures(self) -> list[Result]:
        return [r for r in self.results if r.status != "ok"]
