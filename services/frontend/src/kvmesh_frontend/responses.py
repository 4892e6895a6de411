"""Engine responses to KServe responses: detokenize, apply stop strings, build the output tensors.

One :class:`ResponseWriter` per request. Streaming: each engine response (which may carry several
tokens) becomes one KServe response whose ``text_output`` is the new text (a delta). Not
streaming: the text is accumulated and one response is sent at the end. The last response of a
request carries ``triton_final_response=true`` plus the routing parameters ``kvmesh.worker_id``,
``kvmesh.cached_tokens`` and ``kvmesh.migrations``; when the client asked for
``triton_enable_empty_final_response`` that flag travels on an extra response with no outputs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from inference import grpc_service_pb2 as pb
from kvmesh.v1 import worker_pb2

from kvmesh_frontend.generation import GenerationState
from kvmesh_frontend.llm_request import LlmRequest
from kvmesh_frontend.tensors import add_output, encode_numbers, encode_one_bytes
from kvmesh_frontend.tokenization import IncrementalDetokenizer, ModelTokenizer, StopStrings

FINISH_REASONS = {
    worker_pb2.FINISH_REASON_LENGTH: "length",
    worker_pb2.FINISH_REASON_STOP: "stop",
    worker_pb2.FINISH_REASON_CANCELLED: "abort",
}
FINAL_FLAG = "triton_final_response"
PARAM_WORKER_ID = "kvmesh.worker_id"
PARAM_CACHED_TOKENS = "kvmesh.cached_tokens"
PARAM_MIGRATIONS = "kvmesh.migrations"
PARAM_PREFILL_WORKER_ID = "kvmesh.prefill_worker_id"  # 0: prefilled on the decode engine
PARAM_KV_TRANSFERRED_BLOCKS = "kvmesh.kv_transferred_blocks"
PARAM_KV_TRANSFERRED_BYTES = "kvmesh.kv_transferred_bytes"
PARAM_KV_PULL_EVERYTHING_BYTES = "kvmesh.kv_pull_everything_bytes"  # what pulling every held block would move
PARAM_DISAGG = "kvmesh.disagg"  # "remote", or "local: <why>"

Response = pb.ModelInferResponse | pb.ModelStreamInferResponse


def set_int_param(response: pb.ModelInferResponse, key: str, value: int) -> None:
    if value < 2**63:
        response.parameters[key].int64_param = value
    else:
        response.parameters[key].uint64_param = value


class ResponseWriter:
    """Turns one request's engine responses into KServe responses."""

    def __init__(
        self,
        llm: LlmRequest,
        tokenizer: ModelTokenizer | None,
        prompt: Sequence[int],
        prompt_text: str,
        state: GenerationState,
        *,
        model_version: str = "1",
        unary: bool = False,
    ) -> None:
        self._llm = llm
        self._state = state
        self._unary = unary
        self._stream = llm.stream
        self._num_input = len(prompt)
        self._want_text = llm.wants("text_output")
        self._want_finish = llm.wants("finish_reason")
        self._want_num_in = llm.wants("num_input_tokens")
        self._want_num_out = llm.wants("num_output_tokens")
        self._want_ids = llm.wants("output_ids")
        self._want_cumulative = llm.wants("cumulative_logprob")
        self._want_logprobs = llm.wants("logprobs")
        self._tokenizer = tokenizer
        self.cumulative_logprob = 0.0
        self._logprob_parts: list[dict[str, dict[str, object]]] = []
        self._detok: IncrementalDetokenizer | None = None
        if tokenizer is not None and (self._want_text or llm.sampling.stop):
            self._detok = tokenizer.detokenizer(prompt, llm.sampling.skip_special_tokens)
        self._stops = (  # stop strings match text: the pipeline refuses them for a model without a tokenizer
            StopStrings(llm.sampling.stop, llm.sampling.include_stop_str_in_output)
            if llm.sampling.stop and self._detok is not None
            else None
        )
        self._text_parts: list[str] = [] if llm.exclude_input or self._stream else [prompt_text]
        self._ids: list[int] = []
        self._model = llm.model
        self._version = model_version
        self.num_output_tokens = 0
        self.finish_reason = ""
        self.done = False

    def on_engine(self, engine: worker_pb2.GenerateResponse) -> list[Response]:
        """The KServe responses for one engine response (none, one, or one plus an empty final).

        ModelInferResponse for a unary call, ModelStreamInferResponse on a stream.
        """
        ids: Sequence[int] = engine.token_ids
        steps: Sequence[worker_pb2.TokenLogprobs] = engine.logprobs
        final = engine.finish_reason != 0
        text = ""
        stopped = False
        text_ids = ids
        sampling = self._llm.sampling
        if (
            final
            and ids
            and engine.finish_reason == worker_pb2.FINISH_REASON_STOP
            and not sampling.include_stop_str_in_output
        ):
            # As vLLM: the text of the token that stopped the engine (EOS, or one of stop_token_ids) is left
            # out, and its id stays in output_ids. The EOS's text showed with skip_special_tokens false.
            text_ids = ids[:-1]
        if self._stops is not None:
            text, stopped, kept = self._until_stop(text_ids, final)
            if kept < len(text_ids):  # the tokens after the one that completed the stop string are not output
                ids, steps = ids[:kept], steps[:kept]
        elif self._detok is not None:
            text = self._detok.add(text_ids) if text_ids else ""
            if final:
                text += self._detok.flush()
        self.num_output_tokens += len(ids)
        logprobs: list[dict[str, dict[str, object]]] = []
        if steps:
            self.cumulative_logprob += sum(entry.logprob for entry in steps)
            if self._want_logprobs and self._llm.sampling.logprobs is not None:
                logprobs = [self._logprob_entry(t, e) for t, e in zip(ids, steps, strict=False)]
        if stopped:
            final = True
            self.finish_reason = "stop"
        elif final:
            self.finish_reason = FINISH_REASONS.get(engine.finish_reason, "stop")
        self.done = final
        if self._stream:
            return self._emit(text, ids, len(ids), final, logprobs)
        if text:
            self._text_parts.append(text)
        if self._want_ids:
            self._ids.extend(ids)
        self._logprob_parts.extend(logprobs)
        if not final:
            return []
        return self._emit("".join(self._text_parts), self._ids, self.num_output_tokens, True, self._logprob_parts)

    def _until_stop(self, ids: Sequence[int], final: bool) -> tuple[str, bool, int]:
        """(text, stopped, tokens kept): the text of ``ids`` up to the first stop string.

        Token by token, so that a response carrying several tokens (a stream interval, or deltas merged
        behind a slow client) ends where one token at a time would: at the token that completes the stop
        string, whose successors are dropped (vLLM stops generating there). As in vLLM, the text of the
        first ``min_tokens`` tokens is not searched: it goes out as it is, but a stop string may begin in it
        and end in a later token.
        """
        detok, stops = self._detok, self._stops
        assert detok is not None and stops is not None  # the constructor makes stops only with a detokenizer
        parts: list[str] = []
        unchecked = self._llm.sampling.min_tokens - self.num_output_tokens
        for i, token in enumerate(ids):
            if i < unchecked:
                piece = detok.add((token,))
                stops.seen(piece)
                parts.append(piece)
                continue
            piece, stopped = stops.feed(detok.add((token,)))
            parts.append(piece)
            if stopped:
                return "".join(parts), True, i + 1
        if final:
            piece, stopped = stops.feed(detok.flush())
            parts.append(piece)
            if not stopped:
                parts.append(stops.flush())
            return "".join(parts), stopped, len(ids)
        return "".join(parts), False, len(ids)

    def _logprob_entry(self, token: int, entry: worker_pb2.TokenLogprobs) -> dict[str, dict[str, object]]:
        """One step as vLLM's backend writes it: {token_id: {logprob, rank, decoded_token}}, sampled first."""
        step = {str(token): self._logprob_value(token, entry.logprob, entry.rank)}
        for top in entry.top:
            step.setdefault(str(top.token_id), self._logprob_value(top.token_id, top.logprob, top.rank))
        return step

    def _logprob_value(self, token: int, logprob: float, rank: int) -> dict[str, object]:
        decoded = self._tokenizer.decode([token]) if self._tokenizer is not None else None
        return {"logprob": logprob, "rank": rank, "decoded_token": decoded}

    def _new(self) -> tuple[Response, pb.ModelInferResponse]:
        """A response to fill: a ModelInferResponse (unary) or a ModelStreamInferResponse wrapping one."""
        if self._unary:
            response = pb.ModelInferResponse(
                model_name=self._model, model_version=self._version, id=self._llm.client_id
            )
            return response, response
        outer = pb.ModelStreamInferResponse()
        inner = outer.infer_response
        inner.model_name = self._model
        inner.model_version = self._version
        inner.id = self._llm.client_id
        return outer, inner

    def _emit(
        self,
        text: str,
        ids: Sequence[int],
        num_tokens: int,
        final: bool,
        logprobs: list[dict[str, dict[str, object]]],
    ) -> list[Response]:
        message, response = self._new()
        if self._want_text:
            add_output(response, "text_output", "BYTES", (1,), encode_one_bytes(text.encode()))
        if self._want_finish:
            add_output(
                response,
                "finish_reason",
                "BYTES",
                (1,),
                # str(None), as vLLM's backend writes a request's reason before it finishes
                encode_one_bytes(self.finish_reason.encode() if final else b"None"),
            )
        if self._want_num_in:
            add_output(response, "num_input_tokens", "UINT32", (1,), encode_numbers("UINT32", (self._num_input,)))
        if self._want_num_out:
            add_output(response, "num_output_tokens", "UINT32", (1,), encode_numbers("UINT32", (num_tokens,)))
        if self._want_cumulative:
            add_output(response, "cumulative_logprob", "FP32", (1,), encode_numbers("FP32", (self.cumulative_logprob,)))
        if self._want_logprobs:
            # "null" when sampling_parameters has no "logprobs" key (vLLM then samples none)
            doc = json.dumps(logprobs) if self._llm.sampling.logprobs is not None else "null"
            add_output(response, "logprobs", "BYTES", (1,), encode_one_bytes(doc.encode()))
        if self._want_ids:
            token_ids = list(ids)
            add_output(response, "output_ids", "INT32", (len(token_ids),), encode_numbers("INT32", token_ids))
        if self._unary:
            self._finalize(response)
            return [message]
        if not final:
            response.parameters[FINAL_FLAG].bool_param = False
            return [message]
        if self._llm.empty_final:
            response.parameters[FINAL_FLAG].bool_param = False
            last_message, last = self._new()
            self._finalize(last)
            return [message, last_message]
        self._finalize(response)
        return [message]

    def _finalize(self, response: pb.ModelInferResponse) -> None:
        if not self._unary:
            response.parameters[FINAL_FLAG].bool_param = True
        set_int_param(response, PARAM_WORKER_ID, self._state.engine_id)
        set_int_param(response, PARAM_CACHED_TOKENS, self._state.cached_tokens)
        set_int_param(response, PARAM_MIGRATIONS, self._state.migrations)
        disagg = self._state.disagg
        if disagg.decision:  # a disaggregated model: where the prompt was computed, and why
            set_int_param(response, PARAM_PREFILL_WORKER_ID, disagg.prefill_engine_id)
            set_int_param(response, PARAM_KV_TRANSFERRED_BLOCKS, disagg.transferred_blocks)
            set_int_param(response, PARAM_KV_TRANSFERRED_BYTES, disagg.transferred_bytes)
            set_int_param(response, PARAM_KV_PULL_EVERYTHING_BYTES, disagg.pull_everything_bytes)
            response.parameters[PARAM_DISAGG].string_param = disagg.decision
