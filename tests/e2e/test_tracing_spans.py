"""One trace per request across frontend, router and worker (issue 16.3).

``kvmesh up --otel-exporter console`` runs the real daemons; two requests go out on ONE
ModelStreamInfer stream; after a clean stop (which flushes every exporter) the spans are read back
from the daemons' logs and the tree is checked: a root per request (never one per stream), the
frontend's phases, the router's decision with its engine, overlap and cost, the worker's request with
queue, prefill and decode.
"""

from __future__ import annotations

import json
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
import pytest
from inference import grpc_service_pb2_grpc as pb_grpc

from tests.frontend.frontend_fakes import llm_request
from tests.support.etcd import free_port
from tests.support.kvmesh_up import KvmeshUp

pytestmark = pytest.mark.e2e


def _spans(text: str) -> list[dict[str, Any]]:
    """The JSON spans ConsoleSpanExporter wrote among a daemon's log lines."""
    decoder = json.JSONDecoder()
    spans = []
    at = text.find("{\n")
    while at != -1:
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            end = at + 1
        else:
            if isinstance(value, dict) and "context" in value and "name" in value:
                spans.append(value)
        at = text.find("{\n", end)
    return spans


def _stream_two_requests(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        requests = [llm_request("Tell me about KV caches", model="kvmesh-mock", stream=True, request_id=rid,
                                sampling={"max_tokens": 4, "ignore_eos": True}) for rid in ("a", "b")]  # fmt: skip
        finals = 0
        for message in stub.ModelStreamInfer(iter(requests), timeout=30):
            assert not message.error_message, message.error_message
            if message.infer_response.parameters["triton_final_response"].bool_param:
                finals += 1
                if finals == 2:
                    break


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def test_one_trace_per_request_with_router_and_worker_spans(tmp_path: Path) -> None:
    port = free_port()
    metrics_base = free_port()  # worker here, router +1, frontend +2 (issue 16.4 metrics checked too)
    logs = tmp_path / "logs"
    with KvmeshUp(
        ["--grpc-port", str(port), "--discovery", f"file://{tmp_path / 'disc'}", "--log-dir", str(logs), "--no-demo",
         "--speedup-ratio", "0", "--otel-exporter", "console", "--metrics-port-base", str(metrics_base)],
    ) as up:  # fmt: skip
        up.wait_for("kvmesh is up", 60)
        _stream_two_requests(f"127.0.0.1:{port}")
        worker_metrics, router_metrics = _scrape(metrics_base), _scrape(metrics_base + 1)
        up.stop(30)
    spans = [span for log in logs.glob("*.log") for span in _spans(log.read_text())]
    by_id = {span["context"]["span_id"]: span for span in spans}
    children: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        if span.get("parent_id"):
            children[span["parent_id"]].append(span)

    # (kvmesh up's own readiness probe is a request too: keep ours)
    roots = [s for s in spans if s["name"] == "kvmesh.frontend/request"
             and s["attributes"]["kvmesh.client_request_id"] in ("a", "b")]  # fmt: skip
    assert len(roots) == 2, [s["name"] for s in spans]
    assert all(not root.get("parent_id") for root in roots), "a request on a stream starts its own trace"
    assert len({root["context"]["trace_id"] for root in roots}) == 2, "one trace per request, not per stream"
    assert not [s for s in spans if s["name"].endswith("ModelStreamInfer")], "no span for the whole stream"

    for root in roots:
        attributes = root["attributes"]
        assert attributes["kvmesh.model"] == "kvmesh-mock" and attributes["kvmesh.request_id"]
        kids = {s["name"]: s for s in children[root["context"]["span_id"]]}
        assert {"parse", "tokenize", "route", "first_token", "finish", "kvmesh.v1.WorkerService/Generate"} <= set(
            kids
        ), sorted(kids)
        (decision,) = children[kids["route"]["context"]["span_id"]]
        assert decision["name"] == "kvmesh.router/decision"
        assert decision["resource"]["attributes"]["service.name"] == "kvmesh-router"
        assert decision["attributes"]["kvmesh.engine_id"] == attributes["kvmesh.engine_id"]
        assert {"kvmesh.overlap_blocks", "kvmesh.cost", "kvmesh.mode"} <= set(decision["attributes"])
        worker = kids["kvmesh.v1.WorkerService/Generate"]
        assert worker["resource"]["attributes"]["service.name"] == "kvmesh-worker"
        assert worker["attributes"]["kvmesh.model"] == "kvmesh-mock"
        phases = {s["name"] for s in children[worker["context"]["span_id"]]}
        assert phases == {"queue", "prefill", "decode"}
        assert all(by_id[s["context"]["span_id"]]["context"]["trace_id"] == root["context"]["trace_id"]
                   for s in (decision, worker))  # fmt: skip
    for name in ("queue_time_seconds", "prefill_time_seconds", "time_per_output_token_seconds"):
        assert f'kvmesh_worker_{name}_count{{engine="' in worker_metrics, name
        assert 'model="kvmesh-mock"' in worker_metrics.split(f"kvmesh_worker_{name}_count")[1].split("\n")[0]
    assert "kvmesh_router_decision_quality_ratio_bucket" in router_metrics


def test_a_disaggregated_requests_kv_releases_are_in_its_trace(tmp_path: Path) -> None:
    """The decode worker's ReleaseKv to the prefill worker (and the frontend's own, after the request) are
    calls of the request: each was a trace of its own, two stray roots per disaggregated request."""
    port = free_port()
    logs = tmp_path / "logs"
    with KvmeshUp(
        ["--grpc-port", str(port), "--discovery", f"file://{tmp_path / 'disc'}", "--log-dir", str(logs), "--no-demo",
         "--speedup-ratio", "0", "--otel-exporter", "console", "--prefill-workers", "1", "--decode-workers", "1"],
    ) as up:  # fmt: skip
        up.wait_for("kvmesh is up", 90)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            sampling = {"max_tokens": 4, "ignore_eos": True}
            request = llm_request("KV caches " * 40, model="kvmesh-mock", request_id="pd", sampling=sampling)
            reply = stub.ModelInfer(request, timeout=30)
            assert reply.parameters["kvmesh.disagg"].string_param == "remote"
        up.stop(30)
    spans = [span for log in logs.glob("*.log") for span in _spans(log.read_text())]
    requests = {s["context"]["trace_id"]: s for s in spans if s["name"] == "kvmesh.frontend/request"}
    (ours,) = [t for t, s in requests.items() if s["attributes"]["kvmesh.client_request_id"] == "pd"]
    releases = [s for s in spans if s["name"].endswith("ReleaseKv")]
    assert {s["context"]["trace_id"] for s in releases} <= set(requests), "a release outside any request's trace"
    mine = {(s["resource"]["attributes"]["service.name"], s["kind"]) for s in releases
            if s["context"]["trace_id"] == ours}  # fmt: skip
    # the decode worker's call to the prefill worker, served there; and the frontend's own call
    assert {("kvmesh-worker", "SpanKind.CLIENT"), ("kvmesh-worker", "SpanKind.SERVER")} <= mine, mine
    assert ("kvmesh-frontend", "SpanKind.CLIENT") in mine, mine
