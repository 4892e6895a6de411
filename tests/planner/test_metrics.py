"""The planner's Prometheus metrics say what its latest decision said, and nothing older."""

from __future__ import annotations

from kvmesh_planner.core.model import Decision
from kvmesh_planner.metrics import PlannerMetrics
from prometheus_client import CollectorRegistry, generate_latest


def _decision(decision_id: int, inputs: dict[str, float]) -> Decision:
    sizes = {"aggregated": 2}
    return Decision(decision_id, float(decision_id), "sla", sizes, sizes, "hold", inputs)


def test_an_input_the_latest_decision_did_not_have_is_not_exported() -> None:
    """Traffic stopped: the latest decision has no observed TTFT, and the gauge kept the last one seen."""
    registry = CollectorRegistry()
    metrics = PlannerMetrics(registry)
    metrics.observe(_decision(1, {"observed_ttft_ms": 43.1, "request_rate": 5.0}), {}, {})
    metrics.observe(_decision(2, {"request_rate": 0.0}), {}, {})
    text = generate_latest(registry).decode()
    inputs = [line for line in text.splitlines() if line.startswith("kvmesh_planner_decision_input{")]
    assert inputs == ['kvmesh_planner_decision_input{name="request_rate"} 0.0']
