"""The model a worker serves: its HF-style files and the facts the model card needs from them.

A worker is the source of truth for its model's tokenizer and chat template: frontends fetch the
files over gRPC (WorkerService.GetModelFile) by content digest, so nothing is ever downloaded
from a hub and a frontend never needs the model on its own disk.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

BUILTIN_MODELS = Path(__file__).resolve().parent / "models"
DEFAULT_MODEL = "kvmesh-mock"
SERVED_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")
# Served when the directory has them: the chat template as transformers has saved it since 4.43, and
# the special tokens of older repositories (transformers merges both into the tokenizer's config).
OPTIONAL_FILES = ("chat_template.jinja", "special_tokens_map.json")


class ModelFilesError(ValueError):
    """The model directory is unusable; the message says which file and why."""


@dataclass(frozen=True)
class ModelFiles:
    name: str
    files: dict[str, bytes]
    vocab_size: int
    eos_token_id: int
    max_context: int
    digest: str


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ModelFilesError(f"{path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ModelFilesError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):  # HF config files are JSON objects
        raise ModelFilesError(f"{path}: not a JSON object")
    return data


def _count(path: Path, config: dict[str, Any], *keys: str) -> int:
    """The first of ``keys`` set in ``config``, as a count (0 when none is set)."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelFilesError(f"{path}: {key} must be a non-negative integer, got {json.dumps(value)[:40]}")
        return value
    return 0


def load_model_files(model_path: str | None, served_name: str | None = None) -> ModelFiles:
    """Load ``model_path`` (an HF-style directory) or the built-in ``kvmesh-mock`` model."""
    directory = Path(model_path) if model_path else BUILTIN_MODELS / DEFAULT_MODEL
    if not directory.is_dir():
        raise ModelFilesError(f"{directory}: not a directory")
    missing = [name for name in SERVED_FILES if not (directory / name).is_file()]
    if missing:
        raise ModelFilesError(f"{directory}: missing {', '.join(missing)}")
    try:
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as exc:
        raise ModelFilesError(f"{directory / 'tokenizer.json'}: cannot load tokenizer ({exc})") from None
    tok_config = _json(directory / "tokenizer_config.json")
    config = _json(directory / "config.json")
    eos = tok_config.get("eos_token")
    if eos is None and (directory / "special_tokens_map.json").is_file():  # an older repository's
        eos = _json(directory / "special_tokens_map.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    eos_id = tokenizer.token_to_id(eos) if isinstance(eos, str) else None
    if eos_id is None:
        eos_id = config.get("eos_token_id")
        if isinstance(eos_id, list):
            eos_id = eos_id[0] if eos_id else None
    if not isinstance(eos_id, int):
        raise ModelFilesError(f"{directory}: no eos_token in tokenizer_config.json or eos_token_id in config.json")
    vocab_size = max(
        _count(directory / "config.json", config, "vocab_size"), tokenizer.get_vocab_size(with_added_tokens=True)
    )
    served = [*SERVED_FILES, *(name for name in OPTIONAL_FILES if (directory / name).is_file())]
    files = {name: (directory / name).read_bytes() for name in served}
    digest = hashlib.sha256(b"".join(hashlib.sha256(files[n]).digest() for n in served)).hexdigest()
    max_context = _count(directory / "config.json", config, "max_position_embeddings") or _model_max_length(tok_config)
    return ModelFiles(
        name=served_name or (DEFAULT_MODEL if not model_path else directory.resolve().name),  # '.' has no name
        files=files,
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        max_context=max_context,
        digest=digest,
    )


def _model_max_length(tok_config: dict[str, Any]) -> int:
    """tokenizer_config.json's model_max_length: transformers writes 1e30 there for "no limit" (a float)."""
    value = tok_config.get("model_max_length")
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 2**63 else 0
