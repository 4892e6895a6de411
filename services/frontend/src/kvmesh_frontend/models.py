"""The model registry, fed by the workers' model cards in discovery.

Every worker engine publishes a ``ModelCard`` under ``v1/models/{ns}/{model}/{engine_id:x}``,
attached to its lease: the card's presence *is* the engine's liveness. The registry applies the
discovery watch events (Snapshot / Added / Removed) and keeps, per model name, the live engines'
cards and the limits they advertise. Models appear and disappear live.

Tokenizer files are fetched from an engine (``WorkerService.GetModelFile``) as soon as a model's
first card arrives, and cached by ``files_digest``: many engines (and models) that serve the same
files share one download and one :class:`ModelTokenizer`.

A model name that was seen once and has no live engine now is *known but unavailable*
(UNAVAILABLE); a name never seen is unknown (NOT_FOUND).

An engine whose card vanished is remembered as *departed* for ``departed_s``: every router replica
watches discovery on its own and may still offer it for a moment, so the frontend excludes departed
engines from its route queries. Invariant: once this frontend has dropped an engine, it sends that
engine no new request until the engine registers again.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.channels import ChannelPool
from kvmesh.discovery.base import WatchEvent, apply_watch_event, parse_model_key
from kvmesh.v1 import discovery_pb2, worker_pb2, worker_pb2_grpc

from kvmesh_frontend.errors import clip, invalid, not_found, unavailable
from kvmesh_frontend.tokenization import ModelTokenizer

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
_RETRY_FAILED_LOAD_S = 5.0


#: Every model is served at one version, as Triton reports a model with one version directory: a request
#: may name it or leave the version empty; any other version is NOT_FOUND (Triton's answer).
MODEL_VERSION = "1"
_INT64_MAX = 2**63 - 1
_LEADING_INTEGER = re.compile(r"\s*([+-]?\d+)")


def is_served_version(version: str) -> bool:
    """Whether ``version`` names the served one, read as Triton reads it (``std::stol``: leading blanks, a
    sign, the digits, anything after them ignored, so "01" and " 1" are version 1); raises INVALID_ARGUMENT,
    as Triton does, for a version that is no integer or is negative."""
    if not version:
        return True
    match = _LEADING_INTEGER.match(version)
    if match is None or abs(number := int(match.group(1))) > _INT64_MAX:
        raise invalid(
            f"failed to get model version from specified version string '{clip(version)}', "
            "version should be an integral value > 0"
        )
    if number < 0:
        raise invalid(f"invalid model version specified '{clip(version)}', version should be an integral value > 0")
    return number == int(MODEL_VERSION)


def version_not_found(name: str, version: str) -> str:
    return f"model '{clip(name)}' version {clip(version)} is not found (its one version is {MODEL_VERSION})"


@dataclass(slots=True)
class _Assets:
    """The tokenizer of one files_digest: loading, loaded, absent or failed."""

    digest: str
    task: asyncio.Task[ModelTokenizer | None] | None = None
    tokenizer: ModelTokenizer | None = None
    done: bool = False
    error: str | None = None
    failed_at: float = 0.0


@dataclass(slots=True)
class ModelEntry:
    """One model name and the live engines serving it."""

    name: str
    cards: dict[int, discovery_pb2.ModelCard] = field(default_factory=dict)
    # The block size prompts are hashed with and routed at: the most engines' (ties: the smaller). Engines
    # of another size are not routed to (the router matches and books a query at its block size only).
    block_size: int = 0
    block_sizes: tuple[int, ...] = ()  # every live engine's, when they differ (a --block-size change)
    context_length: int = 0
    vocab_size: int = 0
    eos_token_id: int = 0
    digest: str = ""
    assets: _Assets | None = None
    # Requests the serving engines hold at most: running plus waiting; 0 = no bound (an engine with an
    # unbounded queue, or a card without the field). The frontend's admission bound derives from it.
    capacity: int = 0
    # Worker roles (``discovery_pb2.WorkerRole``) of the live engines: asked on every request, kept here
    # so that the question does not cost a pass over a thousand cards each time.
    roles: frozenset[int] = frozenset()

    @property
    def live(self) -> bool:
        return bool(self.cards)

    @property
    def ready(self) -> bool:
        """A live engine and a settled tokenizer (loaded, absent, or failed to load)."""
        return bool(self.cards) and (self.assets is None or self.assets.done)

    def _refresh(self) -> None:
        cards = list(self.cards.values())
        # prefill engines hold a request only for its prompt: the decode (or aggregated) engines bound it
        serving = [c for c in cards if c.role != discovery_pb2.WORKER_ROLE_PREFILL] or cards
        unbounded = not serving or any(c.max_waiting_requests == 0 for c in serving)
        self.capacity = 0 if unbounded else sum(c.max_num_seqs + c.max_waiting_requests for c in serving)
        self.roles = frozenset(c.role for c in cards)
        if not cards:
            return
        counts = Counter(c.block_size for c in cards if c.block_size)
        self.block_size = max(counts, key=lambda size: (counts[size], -size), default=0)
        sizes = tuple(sorted(counts)) if len(counts) > 1 else ()
        if sizes and sizes != self.block_sizes:
            log.warning(
                "model %s: its engines have block sizes %s; requests are routed at block size %d "
                "(%d engines), the other engines get none",
                self.name, "/".join(map(str, sizes)), self.block_size, counts[self.block_size],
            )  # fmt: skip
        self.block_sizes = sizes
        self.context_length = min((c.context_length for c in cards if c.context_length), default=0)
        self.vocab_size = min((c.vocab_size for c in cards if c.vocab_size), default=0)
        self.eos_token_id = cards[-1].eos_token_id


class ModelRegistry:
    """Models and their live engines, from the discovery watch on ``v1/models/{ns}/``."""

    def __init__(
        self, pool: ChannelPool, namespace: str, fetch_timeout: float = 30.0, departed_s: float = 30.0
    ) -> None:
        self._pool = pool
        self._namespace = namespace
        self._fetch_timeout = fetch_timeout
        self._models: dict[str, ModelEntry] = {}
        self.departed_s = departed_s
        self._departed: dict[str, dict[int, float]] = {}  # model -> engine id -> monotonic time it left
        self._keys: dict[str, tuple[str, int]] = {}  # discovery key -> (model, engine id)
        self._assets: dict[str, _Assets] = {}  # by files digest
        self._closed = False
        self._address_cards: dict[str, int] = {}  # worker address -> live cards at it
        # Called with a worker address once no live engine is left there (its connection can go).
        self.on_address_gone: Callable[[str], None] | None = None
        # Called with a worker address when an engine new to this frontend registers there (a restart).
        self.on_engine_joined: Callable[[str], None] | None = None

    # -- discovery ------------------------------------------------------------------------------
    def apply(self, event: WatchEvent) -> None:
        apply_watch_event(event, self._keys, self._add, self._remove)

    def _add(self, key: str, value: bytes) -> None:
        try:
            parsed = parse_model_key(key)
            card = discovery_pb2.ModelCard.FromString(value)
        except Exception as exc:  # a corrupt record must not take the frontend down
            log.warning("ignoring unreadable model card %s: %s", key, exc)
            return
        if parsed.namespace != self._namespace:
            return
        name = card.name or parsed.model
        engine_id = card.engine_id or parsed.instance_id
        previous = self._keys.get(key)
        if previous is not None and previous[0] != name:
            self._remove(key)
        entry = self._models.get(name)
        if entry is None:
            entry = self._models[name] = ModelEntry(name)
            log.info("model %s appeared (engine %x at %s)", name, engine_id, card.address)
        elif not entry.cards:
            log.info("model %s is back (engine %x at %s)", name, engine_id, card.address)
        replaced = entry.cards.get(engine_id) if self._keys.get(key) == (name, engine_id) else None
        if engine_id not in entry.cards and self.on_engine_joined is not None and card.address:
            self.on_engine_joined(card.address)
        entry.cards[engine_id] = card
        self._keys[key] = (name, engine_id)
        departed = self._departed.get(name)
        if departed is not None and departed.pop(engine_id, None) is not None and not departed:
            del self._departed[name]
        self._count_address(card.address, +1)
        if replaced is not None:
            self._count_address(replaced.address, -1)
        entry._refresh()
        digest = card.files_digest or f"{name}@{engine_id:x}"
        if entry.assets is None or entry.digest != digest:
            entry.digest = digest
            entry.assets = self._assets_for(digest, card)

    def _remove(self, key: str) -> None:
        found = self._keys.pop(key, None)
        if found is None:
            return
        name, engine_id = found
        entry = self._models.get(name)
        if entry is None:
            return
        card = entry.cards.pop(engine_id, None)
        if card is not None:
            self._count_address(card.address, -1)
            self._departed.setdefault(name, {})[engine_id] = time.monotonic()
        entry._refresh()
        if not entry.cards:
            log.info("model %s has no live engine", name)

    def _count_address(self, address: str, delta: int) -> None:
        if not address:
            return
        left = self._address_cards.get(address, 0) + delta
        if left > 0:
            self._address_cards[address] = left
            return
        self._address_cards.pop(address, None)
        if self.on_address_gone is not None:
            self.on_address_gone(address)

    def address_live(self, address: str) -> bool:
        """Whether discovery shows a live engine at this worker address."""
        return address in self._address_cards

    # -- queries --------------------------------------------------------------------------------
    def get(self, name: str) -> ModelEntry | None:
        return self._models.get(name)

    def resolve(self, name: str, version: str = "") -> ModelEntry:
        """The model with a live engine; NOT_FOUND if never seen (or not that version), UNAVAILABLE if no engine now."""
        entry = self._models.get(name)
        if entry is None:
            if not name:
                raise not_found("model_name is empty")
            raise not_found(f"model '{clip(name)}' is not served here (known models: {self.known_names()})")
        if not is_served_version(version):
            raise not_found(version_not_found(name, version))
        if not entry.cards:
            raise unavailable(f"model '{name}' has no live engine")
        return entry

    def names(self) -> list[str]:
        return sorted(name for name, entry in self._models.items() if entry.cards)

    def known_names(self, limit: int = 16) -> str:
        """The served models as an error message lists them: the first ``limit``, then a count."""
        names = self.names()
        shown = ", ".join(names[:limit]) or "none"
        return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"

    def any_ready(self) -> bool:
        return any(entry.ready for entry in self._models.values())

    def engine_alive(self, name: str, pinned: int | None = None, excluded: Sequence[int] = ()) -> bool:
        """Whether a live engine of model ``name`` is eligible (the pinned one, none of the excluded)."""
        entry = self._models.get(name)
        if entry is None:
            return False
        if pinned is not None:
            return pinned in entry.cards and pinned not in excluded
        return any(engine not in excluded for engine in entry.cards)

    def roles(self, name: str) -> frozenset[int]:
        """Worker roles (``discovery_pb2.WorkerRole``) of the model's live engines."""
        entry = self._models.get(name)
        return entry.roles if entry else frozenset()

    def engine_addresses(self, name: str) -> dict[int, str]:
        """``{engine id: worker address}`` of model ``name`` (to exclude every engine of a dead worker)."""
        entry = self._models.get(name)
        return {engine_id: card.address for engine_id, card in entry.cards.items()} if entry else {}

    def departed(self, name: str) -> list[int]:
        """Engines of model ``name`` whose cards vanished less than ``departed_s`` ago (not back since)."""
        departed = self._departed.get(name)
        if not departed:
            return []
        horizon = time.monotonic() - self.departed_s
        for engine_id in [e for e, left in departed.items() if left < horizon]:
            del departed[engine_id]
        if not departed:
            del self._departed[name]
        return list(departed)

    def engines(self, name: str) -> list[int]:
        entry = self._models.get(name)
        return sorted(entry.cards) if entry else []

    async def tokenizer(self, entry: ModelEntry) -> ModelTokenizer | None:
        """The model's tokenizer (None if its engines serve no tokenizer.json); UNAVAILABLE on failure."""
        assets = entry.assets
        if assets is None:
            return None
        if assets.done and assets.error is not None and time.monotonic() - assets.failed_at > _RETRY_FAILED_LOAD_S:
            card = next(iter(entry.cards.values()), None)
            if card is not None:
                self._start_load(assets, card)
        if not assets.done and assets.task is not None:
            await asyncio.shield(assets.task)
        if assets.error is not None:
            raise unavailable(  # which engine failed how is in the log: addresses and parser text stay inside
                f"model '{entry.name}': its tokenizer files could not be loaded from any of its engines "
                f"(retried within {_RETRY_FAILED_LOAD_S:g} s)"
            )
        return assets.tokenizer

    # -- tokenizer loading ----------------------------------------------------------------------
    def _assets_for(self, digest: str, card: discovery_pb2.ModelCard) -> _Assets:
        assets = self._assets.get(digest)
        if assets is None:
            assets = self._assets[digest] = _Assets(digest)
            if "tokenizer.json" in card.files:
                self._start_load(assets, card)
            else:
                assets.done = True
        return assets

    def _start_load(self, assets: _Assets, card: discovery_pb2.ModelCard) -> None:
        assets.done = False
        assets.error = None
        assets.task = asyncio.get_running_loop().create_task(self._load(assets, card.name))

    def _cards_with(self, digest: str, model: str) -> list[discovery_pb2.ModelCard]:
        entry = self._models.get(model)
        cards = list(entry.cards.values()) if entry else []
        return [c for c in cards if (c.files_digest or f"{model}@{c.engine_id:x}") == digest] or cards

    async def _load(self, assets: _Assets, model: str) -> ModelTokenizer | None:
        errors: list[str] = []
        try:
            for card in self._cards_with(assets.digest, model):
                try:
                    files = await asyncio.wait_for(self._fetch(card), self._fetch_timeout)
                    tokenizer = await asyncio.to_thread(ModelTokenizer.from_files, files)
                except Exception as exc:  # any failure: try the next engine
                    errors.append(f"engine {card.engine_id:x} at {card.address}: {exc}")
                    continue
                assets.tokenizer = tokenizer
                log.info("model %s: tokenizer loaded (digest %s)", model, assets.digest[:16])
                return tokenizer
            assets.error = "; ".join(errors) or "no live engine to fetch them from"
            assets.failed_at = time.monotonic()
            log.error("model %s: tokenizer files could not be loaded: %s", model, assets.error)
            return None
        finally:
            assets.done = True

    async def _fetch(self, card: discovery_pb2.ModelCard) -> dict[str, bytes]:
        stub = worker_pb2_grpc.WorkerServiceStub(self._pool.get(card.address, card.address, role="worker"))
        files: dict[str, bytes] = {}
        for name in TOKENIZER_FILES:
            if name not in card.files:
                continue
            chunks = [
                chunk.data
                async for chunk in stub.GetModelFile(
                    worker_pb2.GetModelFileRequest(engine_id=card.engine_id, name=name)
                )
            ]
            files[name] = b"".join(chunks)
        return files

    async def close(self) -> None:
        self._closed = True
        for assets in self._assets.values():
            if assets.task is not None and not assets.task.done():
                assets.task.cancel()
