"""Stock ``tritonclient.grpc`` streaming against a kvmesh frontend, run as a subprocess.

tritonclient's stubs and kvmesh's declare the same proto package (``inference``), so they cannot
share the test process. ``triton_stream.py URL`` reads a JSON list of requests on stdin
(``{"request_id", "prompt" | "ids", "max_tokens", "sampling"}``), sends them on one stream, and
prints ``{request_id: {"text", "num_tokens", "finish_reason", "params": {kvmesh.*}, "chunks"}}`` (plus
``logprobs`` and ``output_ids`` when the request's ``flags`` ask for them); ``chunks`` lists each
response's ``num_output_tokens``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.kserve_clients import mesh
from tests.kserve_clients.mesh import bool_in, llm_inputs, param, stream_requests

EXTRAS: dict[str, dict[str, Any]] = {}
_absorb = mesh.absorb


def _absorb_logprobs(outcome: mesh.Outcome, result: Any) -> None:
    """Also keep the logprob outputs (per-token JSON lists concatenated, the last cumulative)."""
    _absorb(outcome, result)
    extra = EXTRAS.setdefault(result.get_response().id, {"logprobs": [], "chunks": []})
    count = result.as_numpy("num_output_tokens")
    if count is not None and int(count[0]):
        extra["chunks"].append(int(count[0]))
    steps = result.as_numpy("logprobs")
    if steps is not None:
        extra["logprobs"].extend(json.loads(steps[0]) or [])  # "null" without sampling_parameters.logprobs
    ids = result.as_numpy("output_ids")  # with the return_output_ids flag
    if ids is not None:
        extra.setdefault("output_ids", []).extend(int(token) for token in ids)
    cumulative = result.as_numpy("cumulative_logprob")
    if cumulative is not None:
        extra["cumulative_logprob"] = float(cumulative[0])


mesh.absorb = _absorb_logprobs


def main() -> int:
    url = sys.argv[1]
    model = sys.argv[2]
    specs = json.load(sys.stdin)
    requests = [
        {
            "model_name": model,
            "request_id": spec["request_id"],
            "inputs": [
                *llm_inputs(
                    spec.get("prompt"),
                    ids=spec.get("ids"),
                    max_tokens=spec["max_tokens"],
                    sampling=spec.get("sampling"),
                ),
                *(bool_in(name, value) for name, value in spec.get("flags", {}).items()),
            ],
        }
        for spec in specs
    ]
    print("sent", flush=True)
    outcomes = stream_requests(url, requests, timeout=float(sys.argv[3]) if len(sys.argv) > 3 else 120.0)
    report = {}
    for request_id, outcome in outcomes.items():
        assert outcome.final is not None
        params = {
            k: param(outcome.final, k) for k in outcome.final.get_response().parameters if k.startswith("kvmesh.")
        }
        report[request_id] = {
            "text": outcome.text,
            "num_tokens": outcome.num_tokens,
            "finish_reason": outcome.finish_reason,
            "params": params,
            **EXTRAS.get(request_id, {}),
        }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
