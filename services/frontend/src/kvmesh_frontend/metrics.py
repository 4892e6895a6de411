"""Prometheus metrics of the frontend (served on ``--metrics-port`` by the runtime).

All series are labelled by ``model`` (names the registry does not know are folded into
``_unknown`` so a client cannot blow up the label set); request counts and durations also by
``outcome`` (``success``, ``cancelled`` or the lower-case gRPC status name). Observation is per
request or per engine response, never per token: the inter-token latency is each request's mean
gap between tokens after the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

UNKNOWN_MODEL = "_unknown"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


@dataclass(slots=True)
class ModelMetrics:
    """The series of one model, bound once (label lookups are not free)."""

    ttft: Any
    itl: Any
    input_tokens: Any
    output_tokens: Any
    inflight: Any
    migrations: Any
    cached_tokens: Any


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = Counter(
            "kvmesh_frontend_requests",
            "Inference requests finished, by model and outcome",
            ["model", "outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "kvmesh_frontend_request_duration_seconds",
            "Request duration, from arrival to the last response",
            ["model", "outcome"],
            buckets=_DURATION_BUCKETS,
            registry=registry,
        )
        self._ttft = Histogram(
            "kvmesh_frontend_time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self._itl = Histogram(
            "kvmesh_frontend_inter_token_latency_seconds",
            "Mean gap between generated tokens after the first, per request",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self._input_tokens = Histogram(
            "kvmesh_frontend_input_tokens",
            "Prompt length in tokens",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self._output_tokens = Histogram(
            "kvmesh_frontend_output_tokens",
            "Generated tokens per request",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self._inflight = Gauge(
            "kvmesh_frontend_inflight_requests",
            "Requests being served",
            ["model"],
            registry=registry,
        )
        self._migrations = Counter(
            "kvmesh_frontend_migrations",
            "Requests re-issued on another engine after an engine failure",
            ["model"],
            registry=registry,
        )
        self._cached_tokens = Histogram(
            "kvmesh_frontend_router_cached_tokens",
            "Prompt tokens the chosen engine had cached (router overlap)",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self._admission_rejected = Counter(
            "kvmesh_frontend_admission_rejected",
            "Requests refused RESOURCE_EXHAUSTED at the gRPC entry (the model at its in-flight bound), before any work",
            ["model"],
            registry=registry,
        )
        self._models: dict[str, ModelMetrics] = {}
        self._outcomes: dict[tuple[str, str], tuple[Any, Any]] = {}

    def model(self, name: str) -> ModelMetrics:
        bound = self._models.get(name)
        if bound is None:
            bound = self._models[name] = ModelMetrics(
                ttft=self._ttft.labels(name),
                itl=self._itl.labels(name),
                input_tokens=self._input_tokens.labels(name),
                output_tokens=self._output_tokens.labels(name),
                inflight=self._inflight.labels(name),
                migrations=self._migrations.labels(name),
                cached_tokens=self._cached_tokens.labels(name),
            )
        return bound

    def finished(self, model: str, outcome: str, seconds: float) -> None:
        key = (model, outcome)
        pair = self._outcomes.get(key)
        if pair is None:
            pair = self._outcomes[key] = (self.requests.labels(model, outcome), self.duration.labels(model, outcome))
        pair[0].inc()
        pair[1].observe(seconds)

    def admission_rejected(self, model: str) -> None:
        self._admission_rejected.labels(model).inc()

    def migration(self, model: str) -> None:
        self.model(model).migrations.inc()


_default: FrontendMetrics | None = None


def default_metrics() -> FrontendMetrics:
    """The process-wide metrics on prometheus_client's default registry (created once)."""
    global _default
    if _default is None:
        _default = FrontendMetrics()
    return _default
