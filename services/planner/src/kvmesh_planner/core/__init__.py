"""The planner's decision core: pure, synchronous, no I/O and no clock (time comes in the observations).

The daemon (``kvmesh_planner.main``) and the offline simulation (``kvmesh_bench.planner_sim``) drive the
same :class:`PlannerCore`, so what the simulation measures is the decision code that runs in production.
"""

from kvmesh_planner.core.model import (
    POOLS,
    Decision,
    EngineObservation,
    EngineShape,
    Observation,
    PlannerConfig,
    PoolBounds,
    Prediction,
    TrafficObservation,
)
from kvmesh_planner.core.planner import PlannerCore
from kvmesh_planner.core.predictors import make_predictor
from kvmesh_planner.core.profile import EngineProfile, load_profile

__all__ = [
    "POOLS",
    "Decision",
    "EngineObservation",
    "EngineProfile",
    "EngineShape",
    "Observation",
    "PlannerConfig",
    "PlannerCore",
    "PoolBounds",
    "Prediction",
    "TrafficObservation",
    "load_profile",
    "make_predictor",
]
