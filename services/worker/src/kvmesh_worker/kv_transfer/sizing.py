"""The model-true size of one KV block, from an HF ``config.json``."""

from __future__ import annotations

from typing import Any

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1}


def model_bytes_per_block(config: dict[str, Any], block_size: int) -> int | None:
    """layers x 2 (K and V) x kv_heads x head_dim x dtype bytes x tokens per block; None if config lacks them."""
    try:
        layers = int(config["num_hidden_layers"])
        kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    dtype = _DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2)
    return layers * 2 * kv_heads * head_dim * dtype * block_size
