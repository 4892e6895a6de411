"""``--vllm-engine-args``: the user's vLLM engine arguments, checked when the settings load.

Imports nothing from vLLM, so a bad value is refused (one line, exit 2) before the worker spends
10-60 s importing it. vLLM itself checks the argument names when the engine starts.
"""

from __future__ import annotations

import json
from typing import Any

# Engine arguments the worker owns: they wire vLLM into kvmesh and cannot be overridden.
OWNED_ARGS = ("model", "kv_events_config", "skip_tokenizer_init", "enable_prefix_caching", "disable_log_stats")


def parse_engine_args(text: str) -> dict[str, Any]:
    """A JSON object of vLLM ``AsyncEngineArgs`` fields (``-`` or ``_`` in names); ValueError if it is not
    one, or if it sets an argument the worker owns."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError('must be a JSON object of vLLM engine arguments, e.g. {"dtype": "float32"}')
    args = {str(k).replace("-", "_"): v for k, v in value.items()}
    owned = [k for k in OWNED_ARGS if k in args]
    if owned:
        verb = "is" if len(owned) == 1 else "are"
        raise ValueError(f"{', '.join(owned)} {verb} set by the worker (see docs/vllm.md)")
    return args
