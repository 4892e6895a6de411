"""Which engine implementation ``--engine NAME`` builds.

A name is either registered here (``mocker``) or an import path ``package.module:factory``, so an
engine that lives outside this package (a test's echo engine, a plug-in) is served by the real
``kvmesh-worker`` without editing the worker. A factory has the signature of :data:`EngineFactory`:
it gets the worker's settings (its field names are the flag dests, e.g. ``settings.num_gpu_blocks``)
and the model files, checks them (raising :class:`EngineBuildError` with a message for the command
line) and returns a function that makes one :class:`~kvmesh_worker.engines.Engine`, not started yet,
for an engine id. Two steps because a bad configuration must fail before the worker joins
discovery, while the engine ids come from its discovery instance id.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from kvmesh_worker.model_files import ModelFiles

from .api import Engine

EngineMaker = Callable[[int], Engine]
EngineFactory = Callable[[Any, ModelFiles], EngineMaker]

# name -> "module:factory", imported only when picked (a vLLM engine must not cost the mocker an import).
ENGINES: dict[str, str] = {
    "mocker": "kvmesh_worker.engines.mocker:build",
    "vllm": "kvmesh_worker.engines.vllm.engine:build",  # needs the vLLM venv (make setup-vllm)
}


class EngineBuildError(ValueError):
    """The engine cannot be built from these settings; the message says why, for the command line."""


def engine_name(value: str) -> str:
    """The ``--engine`` flag's type: a registered name or a ``module:factory`` import path."""
    if value in ENGINES or _is_import_path(value):
        return value
    raise ValueError(f"unknown engine {value!r}: choose {', '.join(ENGINES)} or give module:factory")


def _is_import_path(value: str) -> bool:
    module, sep, attr = value.partition(":")
    return bool(sep) and all(part.isidentifier() for part in (*module.split("."), attr))


def resolve(name: str) -> EngineFactory:
    """The factory for ``name``; raises EngineBuildError when it cannot be imported."""
    module_name, _, attr = ENGINES.get(name, name).partition(":")
    try:
        factory: EngineFactory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise EngineBuildError(f"--engine {name}: cannot import {module_name}:{attr}: {exc}") from exc
    if not callable(factory):
        raise EngineBuildError(f"--engine {name}: {module_name}:{attr} is not callable")
    try:
        inspect.signature(factory).bind(None, None)
    except (TypeError, ValueError):  # ValueError: a builtin without a signature
        raise EngineBuildError(
            f"--engine {name}: {module_name}:{attr} is not an engine factory (it must take settings, model files)"
        ) from None
    return factory


def build(name: str, settings: Any, model: ModelFiles) -> EngineMaker:
    """Check the settings for engine ``name`` and return what makes one such engine per engine id."""
    return resolve(name)(settings, model)
