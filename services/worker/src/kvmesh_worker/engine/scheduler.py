"""vLLM-v1-style continuous-batching scheduler over the block manager.

One pass (``schedule``) spends a single token budget (``max_num_batched_tokens``) on the running
requests first, in admission order, then admits waiting ones (up to ``max_num_seqs``). Every request
is just "tokens known" vs "tokens computed": a prefill is a large gap (chunked to the remaining
budget), a decode a gap of one, a resumed preempted request recomputes prompt + output so far. A
prefix-cache hit counts as computed (at least one token is always computed, to produce the next one).

Blocks are allocated per pass for exactly the tokens scheduled, and a block is stored (hashed,
announced) when the pass that fills it is scheduled. When an allocation fails the scheduler preempts
(LIFO: the most recently admitted running request; FIFO: the oldest), resets the victim to nothing
computed (its blocks are deref'd, so they stay cached and usually hit on resume), puts it at the
front of the waiting queue, retries, and admits nothing new for the rest of that pass.

Admission also needs the whole known sequence to fit under the KV watermark (Dynamo's mocker:
active blocks + the request's blocks not already active <= (1 - watermark) * num_gpu_blocks).

``update`` then applies the simulated model output: requests whose known tokens are all computed
get one new token; requests reaching ``max_tokens`` or a stop token finish and release their blocks.

Cost per pass: O(1) per running request plus O(blocks changed); a decode step of a request touches
the block manager only once every ``block_size`` tokens. Only admission looks at a request's whole
prefix (one dict lookup per block).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import xxhash
from kvmesh.hashing import block_hashes, chain_hash, salted_seed

from .api import EngineRequest, FinishReason, RequestOutput
from .block_manager import BlockManager
from .config import EngineConfig, PreemptionMode
from .generation import PLAN_CHUNK, first_stop, generation_key, sample_tokens


class Request:
    """A request's mutable scheduling state (internal)."""

    __slots__ = (
        "blocks",
        "finish_at",
        "finish_reason",
        "gen_key",
        "hash_seed",
        "hashes",
        "local_hashes",
        "max_tokens",
        "min_tokens",
        "num_cached_prompt_tokens",
        "num_computed",
        "num_full",
        "num_output",
        "num_prompt_tokens",
        "num_tokens",
        "plan",
        "prefill_done",
        "prompt",
        "request_id",
        "scheduled",
        "stop_ids",
        "waiting",
    )

    def __init__(self, request: EngineRequest, prompt: np.ndarray, config: EngineConfig) -> None:
        self.request_id = request.request_id
        self.prompt = prompt  # uint32
        self.num_prompt_tokens = self.num_tokens = len(prompt)  # known tokens: prompt + output so far
        self.max_tokens = request.max_tokens
        # no stop (EOS included) among the first min_tokens output tokens, as in vLLM
        self.min_tokens = request.sampling.min_tokens if request.sampling is not None else 0
        stops = set(request.stop_token_ids)
        if not request.ignore_eos:
            stops.add(config.eos_token_id)
        self.stop_ids = frozenset(stops)
        self.hash_seed = salted_seed(request.cache_salt)
        # Hashes of the full blocks whose tokens are known (the prompt's now, generated ones as they fill).
        given = request.prompt_hashes
        if given is not None and not request.cache_salt and len(given[1]) == len(prompt) // config.block_size:
            self.local_hashes, self.hashes = list(given[0]), list(given[1])
        else:
            self.local_hashes, self.hashes = block_hashes(prompt, config.block_size, self.hash_seed)
        self.gen_key = generation_key(prompt, request.seed)
        self.plan: list[int] = []  # output tokens sampled ahead; the output so far is plan[:num_output]
        self.finish_at = request.max_tokens  # output count at which the request finishes ...
        self.finish_reason: FinishReason = "length"  # ... and why (until a stop token is sampled earlier)
        self.num_output = 0
        self.num_computed = 0  # tokens whose KV is computed (or cached)
        self.blocks: list[int] = []  # block keys held, in sequence order (full blocks, then maybe one partial)
        self.num_full = 0  # how many of ``blocks`` are full
        self.prefill_done = False  # False while (re)computing the known tokens; True once decoding
        self.num_cached_prompt_tokens: int | None = None  # prefix-cache hit at first admission
        self.scheduled = 0  # tokens scheduled in the current pass
        self.waiting = True

    @property
    def pending_prefill_tokens(self) -> int:
        return 0 if self.prefill_done else self.num_tokens - self.num_computed


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pending_prefill_tokens = 0  # sum of Request.pending_prefill_tokens, kept incrementally
        self._admit_limit = config.num_gpu_blocks - config.watermark_blocks
        self._bs = config.block_size
        self._lifo = config.preemption_mode is PreemptionMode.LIFO
        self._emit_ids = config.emit_token_ids

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------------------------- request entry

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.pending_prefill_tokens += request.num_tokens

    def abort(self, request_id: str) -> bool:
        """Drop a request and release its blocks now; False if it is not here (unknown or finished)."""
        r = self.requests.pop(request_id, None)
        if r is None:
            return False
        self.pending_prefill_tokens -= r.pending_prefill_tokens
        if r.waiting:
            self.waiting.remove(r)
        else:
            self.running.remove(r)
            self.bm.deref(r.blocks)
            r.blocks = []
        return True

    # ---------------------------------------------------------------------------------------- schedule

    def schedule(self) -> tuple[list[Request], int]:
        """One pass's decisions: (requests scheduled, each with ``scheduled`` tokens; requests preempted)."""
        bs = self._bs
        budget = self.config.max_num_batched_tokens
        running = self.running
        scheduled: list[Request] = []
        num_preempted = 0
        lifo = self._lifo

        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            c = r.num_computed
            num_new = r.num_tokens - c
            if num_new > budget:
                num_new = budget
            # Fast path: a decode token inside a block changes no block.
            if num_new != 1 or not c % bs or not (c + 1) % bs:
                ok = self._allocate(r, num_new)
                while not ok:
                    victim = running.pop() if lifo else running.pop(0)
                    self._preempt(victim)
                    num_preempted += 1
                    if victim is r:
                        break
                    if not lifo:  # the victim was ahead of r: it was scheduled in this pass already
                        i -= 1
                        budget += victim.scheduled
                        scheduled.remove(victim)
                    ok = self._allocate(r, num_new)
                if not ok:
                    continue  # r itself was preempted; running[i] is now the next request (or none)
            r.scheduled = num_new
            scheduled.append(r)
            budget -= num_new
            i += 1

        if self.waiting and not num_preempted:
            self._admit(scheduled, budget)
        return scheduled, num_preempted

    def _admit(self, scheduled: list[Request], budget: int) -> None:
        cfg, bm = self.config, self.bm
        bs = cfg.block_size
        waiting, running = self.waiting, self.running
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            r = waiting[0]
            self._ensure_hashes(r, r.num_tokens // bs)  # a resumed request's generated blocks
            hits, active_hits = bm.match_prefix(r.hashes, (r.num_tokens - 1) // bs)
            if bm.num_active + -(-r.num_tokens // bs) - active_hits > self._admit_limit:
                break  # watermark: wait for running requests to finish
            cached = hits * bs
            num_new = r.num_tokens - cached
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break
                num_new = budget
            r.num_computed = cached
            if not self._allocate(r, num_new):  # cannot fail after the watermark check; stay safe
                r.num_computed = 0
                break
            waiting.popleft()
            r.waiting = False
            running.append(r)
            self.pending_prefill_tokens -= cached
            if r.num_cached_prompt_tokens is None:
                r.num_cached_prompt_tokens = cached
            r.scheduled = num_new
            scheduled.append(r)
            budget -= num_new

    def _allocate(self, r: Request, num_new: int) -> bool:
        """Hold blocks for r's first ``num_computed + num_new`` tokens; False (nothing changed) if they don't fit.

        Full blocks below the target are used (stored if new); a held partial block that the target
        fills is promoted; a partial tail gets a fresh partial block.
        """
        bm, bs = self.bm, self._bs
        target = r.num_computed + num_new
        full_target = target // bs
        nfull, blocks = r.num_full, r.blocks
        has_partial = len(blocks) > nfull
        promote = has_partial and full_target > nfull
        lo = nfull + promote
        new_partial = target % bs != 0 and (full_target > nfull or not has_partial)
        if full_target > nfull:
            self._ensure_hashes(r, full_target)
        hashes = r.hashes
        need = new_partial + (bm.num_missing(hashes, lo, full_target) if full_target > lo else 0)
        if need > bm.free_slots:
            return False
        if promote:
            parent = hashes[nfull - 1] if nfull else None
            bm.promote(blocks[nfull], hashes[nfull], r.local_hashes[nfull], parent, nfull)
            blocks[nfull] = hashes[nfull]
        if full_target > lo:
            bm.use(hashes, r.local_hashes, lo, full_target)
            blocks.extend(hashes[lo:full_target])
        r.num_full = full_target
        if new_partial:
            blocks.append(bm.new_partial())
        return True

    def _preempt(self, r: Request) -> None:
        self.bm.deref(r.blocks)
        self.pending_prefill_tokens += r.num_tokens - r.pending_prefill_tokens
        r.blocks = []
        r.num_full = 0
        r.num_computed = 0
        r.prefill_done = False
        r.waiting = True
        self.waiting.appendleft(r)

    def _ensure_hashes(self, r: Request, num_blocks: int) -> None:
        """Hash r's full blocks up to ``num_blocks`` (those past the prompt hold generated tokens)."""
        hashes = r.hashes
        if len(hashes) >= num_blocks:
            return
        bs, p = self.config.block_size, r.num_prompt_tokens
        while len(hashes) < num_blocks:
            k = len(hashes)
            lo, hi = k * bs, (k + 1) * bs
            out = np.array(r.plan[max(0, lo - p) : hi - p], dtype="<u4")
            tokens = out if lo >= p else np.concatenate((r.prompt[lo:], out))
            local = xxhash.xxh3_64_intdigest(tokens.tobytes(), r.hash_seed)
            r.local_hashes.append(local)
            hashes.append(chain_hash(hashes[-1], local, r.hash_seed) if k else local)

    # ------------------------------------------------------------------------------------------ update

    def update(self, scheduled: list[Request]) -> tuple[list[RequestOutput], int, int, int, int]:
        """Apply one simulated forward pass: count computed tokens, emit the new tokens, finish requests.

        Returns (outputs, prefill requests, prefill tokens, decode requests, summed decode context).
        """
        outputs: list[RequestOutput] = []
        emit_ids = self._emit_ids
        num_prefill = prefill_tokens = num_decode = context_tokens = 0
        finished = False
        for r in scheduled:
            n = r.scheduled
            c = r.num_computed + n
            r.num_computed = c
            if r.prefill_done:
                num_decode += 1
                context_tokens += c
            else:
                num_prefill += 1
                prefill_tokens += n
                if c < r.num_tokens:
                    continue  # a chunk of a longer prefill: no token yet
                r.prefill_done = True
            k = r.num_output
            if k == len(r.plan):
                self._extend_plan(r)
            k += 1
            r.num_output = k
            r.num_tokens += 1
            if k == r.finish_at:
                finished = True
                self._finish(r)
                ids = (r.plan[k - 1],) if emit_ids else ()
                cached = r.num_cached_prompt_tokens if k == 1 else None
                outputs.append(RequestOutput(r.request_id, ids, k, True, r.finish_reason, cached))
            elif emit_ids:
                cached = r.num_cached_prompt_tokens if k == 1 else None
                outputs.append(RequestOutput(r.request_id, (r.plan[k - 1],), k, False, None, cached))
            elif k == 1:
                outputs.append(RequestOutput(r.request_id, (), 1, False, None, r.num_cached_prompt_tokens))
        self.pending_prefill_tokens -= prefill_tokens
        if finished:
            requests = self.requests
            self.running = [r for r in self.running if requests.get(r.request_id) is r]
        return outputs, num_prefill, prefill_tokens, num_decode, context_tokens

    # ---------------------------------------------------------------------------------- quiet passes

    def quiet_passes(self) -> int:
        """How many upcoming passes are *quiet*: pure decode, and changing nothing but token counts.

        In a quiet pass nobody waits, every running request decodes one token into the block it
        already holds (no block opens or fills, so no allocation, promotion, preemption or event),
        and nobody finishes. Consecutive quiet passes are identical but for the context lengths,
        so ``skip`` can apply k of them at once. At most ``block_size - 2``: a block boundary ends it.
        """
        running = self.running
        if self.waiting or not running or len(running) > self.config.max_num_batched_tokens:
            return 0
        bs = self._bs
        quiet = bs
        for r in running:
            if not r.prefill_done:
                return 0
            pos = r.num_computed % bs  # the next pass computes this slot of the request's last block
            if pos == 0 or pos == bs - 1:
                return 0
            quiet = min(quiet, bs - 1 - pos)
            while len(r.plan) < min(r.finish_at, r.num_output + quiet + 1):
                self._extend_plan(r)  # may find a stop token, moving finish_at closer
            quiet = min(quiet, r.finish_at - r.num_output - 1)
            if quiet <= 0:
                return 0
        return quiet

    def skip(self, passes: int) -> None:
        """Apply ``passes`` quiet passes (the caller checked ``passes <= quiet_passes()``)."""
        for r in self.running:
            r.num_computed += passes
            r.num_output += passes
            r.num_tokens += passes

    def _extend_plan(self, r: Request) -> None:
        start = len(r.plan)
        tokens = sample_tokens(r.gen_key, start, min(PLAN_CHUNK, r.finish_at - start), self.config.vocab_size)
        skip = max(0, r.min_tokens - start)  # the first min_tokens output tokens cannot stop it (vLLM masks them)
        stop = first_stop(tokens[skip:], r.stop_ids) if skip < len(tokens) else -1
        if stop >= 0:
            stop += skip
        if stop >= 0 and start + stop + 1 < r.finish_at:
            r.finish_at = start + stop + 1
            r.finish_reason = "stop"
        r.plan.extend(tokens.tolist())

    def _finish(self, r: Request) -> None:
        del self.requests[r.request_id]
        self.bm.deref(r.blocks)
        r.blocks = []
