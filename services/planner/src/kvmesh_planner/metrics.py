"""Prometheus metrics of the planner: every decision's sizes, inputs and prediction, and leadership."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from kvmesh_planner.core.model import POOLS, Decision, Pool


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.leader = Gauge("kvmesh_planner_leader", "1 while this planner replica leads (acts)", registry=registry)
        self.decisions = Counter(
            "kvmesh_planner_decisions", "Decisions made, by whether they changed a pool", ["changed"], registry=registry
        )
        self.target = Gauge(
            "kvmesh_planner_pool_target", "Engines the latest decision asks for", ["pool"], registry=registry
        )
        self.actual = Gauge(
            "kvmesh_planner_pool_actual", "Engines that exist (ready or starting)", ["pool"], registry=registry
        )
        self.starting = Gauge("kvmesh_planner_pool_starting", "Engines starting", ["pool"], registry=registry)
        self.draining = Gauge("kvmesh_planner_pool_draining", "Engines draining", ["pool"], registry=registry)
        self.inputs = Gauge(
            "kvmesh_planner_decision_input", "The latest decision's inputs, by name", ["name"], registry=registry
        )
        self.predicted = Gauge(
            "kvmesh_planner_prediction", "The SLA mode's latest prediction, by figure", ["figure"], registry=registry
        )

    def observe(self, d: Decision, starting: dict[Pool, int], draining: dict[Pool, int]) -> None:
        self.decisions.labels("true" if d.changed else "false").inc()
        for pool in POOLS:
            if pool in d.target:
                self.target.labels(pool).set(d.target[pool])
                self.actual.labels(pool).set(d.previous.get(pool, 0))
                self.starting.labels(pool).set(starting.get(pool, 0))
                self.draining.labels(pool).set(draining.get(pool, 0))
        self.inputs.clear()  # an input the latest decision did not have (no traffic: no observed TTFT) is gone
        for name, value in d.inputs.items():
            self.inputs.labels(name).set(value)
        if d.prediction is not None:
            q = d.prediction
            for figure, value in (
                ("request_rate", q.request_rate),
                ("isl", q.isl),
                ("osl", q.osl),
                ("ttft_correction", q.ttft_correction),
                ("itl_correction", q.itl_correction),
                ("engine_request_rate", q.engine_request_rate),
            ):
                self.predicted.labels(figure).set(value)
