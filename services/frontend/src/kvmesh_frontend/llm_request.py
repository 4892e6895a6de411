"""The LLM tensor contract (Triton vLLM backend, plus what genai-perf and tokenizing clients send).

(About 500 lines: the contract below and the checker of each input and sampling key it names are read
together; split, one table would be checked in two places.)

:func:`parse_llm_request` turns a ``ModelInferRequest`` into a validated :class:`LlmRequest` or
raises INVALID_ARGUMENT naming the tensor (or parameter) and what is wrong with it. Nothing here
knows the model: limits that depend on the model card (vocabulary, context length, chat template)
are checked once the model is resolved.

Inputs (all optional individually; exactly one of ``text_input`` / ``input_ids`` / ``messages``):

==========================  ============  =====================================================
``text_input``              BYTES [1]     the prompt, UTF-8
``input_ids``               INT32/INT64   pre-tokenized prompt, [N] or [1, N]
``messages``                BYTES [1]     JSON list of OpenAI chat messages (chat template)
``stream`` / ``streaming``  BOOL [1]      one response per engine step (ModelStreamInfer only)
``sampling_parameters``     BYTES [1]     JSON of vLLM SamplingParams (see SAMPLING_KEYS)
``exclude_input_in_output`` BOOL [1]      default: true when streaming, false otherwise
``return_finish_reason``    BOOL [1]      add the ``finish_reason`` output
``return_num_input_tokens`` BOOL [1]      add the ``num_input_tokens`` output
``return_num_output_tokens`` BOOL [1]     add the ``num_output_tokens`` output (delta per response)
``return_logprobs``         BOOL [1]      add ``logprobs`` (needs ``sampling_parameters.logprobs``)
``return_cumulative_logprob`` BOOL [1]    add ``cumulative_logprob``
``return_output_ids``       BOOL [1]      add ``output_ids`` (kvmesh's own flag)
``max_tokens``              INT32/INT64   TensorRT-LLM style (genai-perf ``--backend tensorrtllm``)
``min_length``              INT32/INT64   TensorRT-LLM style minimum output length
==========================  ============  =====================================================

An output is sent when its ``return_*`` flag is true (``text_output`` always), like Triton's vLLM
backend, and, when the request names ``outputs``, only if named: perf_analyzer names every output.

Sampling keys are read, lowest precedence first, from the request ``parameters`` map, the
``sampling_parameters`` JSON, then the ``max_tokens`` / ``min_length`` tensors. Numbers may be
sent as strings (genai-perf sends ``{"max_tokens": "16"}``).

Input limits (:func:`input_limits`) are checked before any tensor is decoded, JSON parsed or prompt
tokenized: a prompt's bytes are bounded by the model's context length (``PROMPT_BYTES_PER_TOKEN``
per token), ``input_ids`` by the context length itself, everything else by small fixed sizes, and
JSON nesting by ``MAX_JSON_DEPTH``. Work on a request that cannot fit the model is never started.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from inference import grpc_service_pb2 as pb
from kvmesh.v1 import router_pb2

from kvmesh_frontend.errors import MAX_ECHO_CHARS, clip, invalid
from kvmesh_frontend.prompt_tokens import PromptTokens
from kvmesh_frontend.tensors import SHARED_MEMORY_REGION, Tensor, TensorLimit, decode_inputs

PROMPT_INPUTS = ("text_input", "input_ids", "messages")

# name -> accepted datatypes
INPUT_DATATYPES: dict[str, tuple[str, ...]] = {
    "text_input": ("BYTES",),
    "input_ids": ("INT32", "INT64"),
    "messages": ("BYTES",),
    "stream": ("BOOL",),
    "streaming": ("BOOL",),
    "sampling_parameters": ("BYTES",),
    "exclude_input_in_output": ("BOOL",),
    "return_finish_reason": ("BOOL",),
    "return_num_input_tokens": ("BOOL",),
    "return_num_output_tokens": ("BOOL",),
    "return_cumulative_logprob": ("BOOL",),
    "return_logprobs": ("BOOL",),
    "return_output_ids": ("BOOL",),
    "max_tokens": ("INT32", "INT64"),
    "min_length": ("INT32", "INT64"),
}
# Output -> the input flag that enables it (text_output needs none).
OUTPUT_FLAGS: dict[str, str] = {
    "finish_reason": "return_finish_reason",
    "num_input_tokens": "return_num_input_tokens",
    "num_output_tokens": "return_num_output_tokens",
    "cumulative_logprob": "return_cumulative_logprob",
    "logprobs": "return_logprobs",
    "output_ids": "return_output_ids",
}
OUTPUTS = ("text_output", *OUTPUT_FLAGS)

ROUTER_MODES: dict[str, int] = {
    "kv": router_pb2.ROUTER_MODE_KV,
    "round_robin": router_pb2.ROUTER_MODE_ROUND_ROBIN,
    "random": router_pb2.ROUTER_MODE_RANDOM,
    "power_of_two": router_pb2.ROUTER_MODE_POWER_OF_TWO,
    "direct": router_pb2.ROUTER_MODE_DIRECT,
}

# -- input limits (see docs/frontend.md, "Input limits") ----------------------------------------
# A token is 3-5 bytes of UTF-8 in practice; 16 leaves room for long whitespace or digit runs, so a
# prompt refused for its bytes could not have fit the context anyway.
PROMPT_BYTES_PER_TOKEN = 16
# When no model card states a context length.
DEFAULT_MAX_PROMPT_TOKENS = 1 << 20
_MAX_TOKEN_ID = 0xFFFF_FFFF  # token ids travel as u32 (GenerateRequest.token_ids_u32le)
MAX_SAMPLING_JSON_BYTES = 64 * 1024
MAX_JSON_DEPTH = 32
MAX_STOP_TOKEN_IDS = 1024  # stop token ids per request (the worker's bound too: each is checked per token)
MAX_STOP_STRINGS = 64  # stop strings per request (OpenAI takes 4; each costs a search per token)
MAX_SCALAR_ELEMENTS = 16  # a scalar input must hold 1; a few more still get the precise message
MAX_PARAMETERS = 64
MAX_ID_CHARS = 4096  # the request id comes back in every response of its stream
MAX_PARAMETER_STRING_BYTES = 4096
MAX_REQUESTED_OUTPUTS = 16

PARAM_WORKER_ID = "kvmesh.worker_id"
PARAM_ROUTER_MODE = "kvmesh.router_mode"
PARAM_ROUTER_POLICY = "kvmesh.router_policy"
PARAM_EMPTY_FINAL = "triton_enable_empty_final_response"
# Request parameters that are never sampling keys (Triton reserved ones and ours).
_RESERVED_PARAMS = frozenset(
    ["sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers", "binary_data_output"]
)


@dataclass(slots=True)
class SamplingParams:
    """Generation controls; None means "the engine's / frontend's default"."""

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # alternatives per token for the ``logprobs`` output (vLLM's key)
    stream_interval: int | None = None  # tokens per streamed response after the first (vLLM's key)


@dataclass(slots=True)
class LlmRequest:
    """A validated LLM request, still independent of the model."""

    model: str
    client_id: str
    text: str | None = None
    input_ids: PromptTokens | None = None
    messages: list[dict[str, Any]] | None = None
    stream: bool = False
    exclude_input: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)
    flags: frozenset[str] = frozenset()  # the return_* inputs that are true
    requested_outputs: tuple[str, ...] = ()
    empty_final: bool = False
    pinned_engine_id: int | None = None
    router_mode: int = router_pb2.ROUTER_MODE_UNSPECIFIED
    router_policy: str | None = None  # kv cost policy override (the router validates the name)

    @property
    def prompt_input(self) -> str:
        if self.text is not None:
            return "text_input"
        if self.input_ids is not None:
            return "input_ids"
        return "messages"

    def wants(self, output: str) -> bool:
        """Whether responses carry this output: enabled by its flag, and named if ``outputs`` names any.

        Triton's vLLM backend produces only ``text_output`` unless a ``return_*`` input asks for
        more, and Triton then drops what the request's ``outputs`` do not name.
        """
        if self.requested_outputs and output not in self.requested_outputs:
            return False
        return output == "text_output" or OUTPUT_FLAGS.get(output) in self.flags


@functools.lru_cache(maxsize=64)
def input_limits(context_length: int = 0, model: str = "") -> Mapping[str, TensorLimit]:
    """The most each input may hold for a model with this context length (0: not stated)."""
    max_tokens = context_length - 1 if context_length > 1 else DEFAULT_MAX_PROMPT_TOKENS
    prompt_bytes = max_tokens * PROMPT_BYTES_PER_TOKEN
    if context_length > 1:
        about = f"model '{clip(model)}' has a context length of {context_length} tokens"
    else:
        about = f"no context length is stated; at most {max_tokens} prompt tokens are accepted"
    prompt_why = f"{about}; a prompt may take at most {PROMPT_BYTES_PER_TOKEN} bytes per token"
    limits: dict[str, TensorLimit] = {}
    for name, datatypes in INPUT_DATATYPES.items():
        if name in ("text_input", "messages"):
            limit = TensorLimit(MAX_SCALAR_ELEMENTS, prompt_bytes + 4 * MAX_SCALAR_ELEMENTS, prompt_why)
        elif name == "input_ids":
            limit = TensorLimit(max_tokens, 8 * max_tokens, about)
        elif name == "sampling_parameters":
            limit = TensorLimit(MAX_SCALAR_ELEMENTS, MAX_SAMPLING_JSON_BYTES, "the JSON of sampling parameters")
        else:
            limit = TensorLimit(MAX_SCALAR_ELEMENTS, 8 * MAX_SCALAR_ELEMENTS, f"a {datatypes[0]} [1] scalar")
        limits[name] = limit
    return limits


def _load_json(name: str, text: str) -> Any:
    """Parse a JSON input; malformed or too deeply nested JSON is INVALID_ARGUMENT.

    Python's parser recurses per nesting level, so ``"[" * 100000`` raises RecursionError; what
    parses is still held to ``MAX_JSON_DEPTH`` because later code (error messages that echo a value,
    the chat template) walks it recursively too.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid(f"input '{name}': not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except ValueError:  # an integer of more digits than int() converts (sys.get_int_max_str_digits)
        raise invalid(f"input '{name}': not valid JSON here (a number with too many digits)") from None
    except RecursionError:
        doc = None
        depth = MAX_JSON_DEPTH + 1
    else:
        depth = _json_depth(doc)
    if depth > MAX_JSON_DEPTH:
        raise invalid(f"input '{name}': JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return doc


def _json_depth(doc: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: the value may be deeper than the stack)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        elif not isinstance(value, list):
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        stack.extend((item, depth + 1) for item in value)
    return deepest


def _shown(value: Any) -> str:
    """A client's value as an error message echoes it: JSON, clipped."""
    try:
        return clip(json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        return clip(value)


# -- value coercion (JSON values, parameter values, strings) -------------------------------------
def _as_int(where: str, value: Any) -> int:
    if isinstance(value, bool):
        raise invalid(f"{where} must be an integer, got {_shown(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)  # as the vLLM backend reads it: base 10, "016" is 16, "0x10" is refused
        except ValueError:
            pass
    raise invalid(f"{where} must be an integer, got {_shown(value)}")


def _as_float(where: str, value: Any) -> float:
    if isinstance(value, bool):
        raise invalid(f"{where} must be a number, got {_shown(value)}")
    try:
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            return float(value)
    except OverflowError:  # an integer beyond any float (JSON integers are unbounded)
        raise invalid(f"{where} is out of range, got {_shown(value)}") from None
    except ValueError:
        pass
    raise invalid(f"{where} must be a number, got {_shown(value)}")


def _as_bool(where: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise invalid(f"{where} must be a boolean, got {_shown(value)}")


def _vllm_int(where: str, value: Any) -> int:
    """An integer the way Triton's vLLM backend reads one (``int(value)``): 16, "16", 16.0, 16.9 -> 16."""
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        return int(value)
    return _as_int(where, value)


_NO_PARAMETER = pb.InferParameter()
U32_MAX = 2**32 - 1  # the largest a uint32 field of the worker contract (SamplingOptions) holds


def _int_at_least(minimum: int, *, lenient: bool = False, maximum: int = U32_MAX) -> Callable[[str, Any], int]:
    def parse(where: str, value: Any) -> int:
        number = _vllm_int(where, value) if lenient else _as_int(where, value)
        if number < minimum:
            raise invalid(f"{where} must be >= {minimum}, got {clip(str(number))}")
        if number > maximum:
            raise invalid(f"{where} must be <= {maximum}, got {clip(str(number))}")
        return number

    return parse


F32_MAX = float(np.finfo(np.float32).max)  # SamplingOptions' floats are 32-bit: a larger value becomes inf there
F32_TINY = float(np.finfo(np.float32).smallest_subnormal)  # a positive value below it becomes 0 there


def _temperature(where: str, value: Any) -> float:
    number = _as_float(where, value)
    if not 0 <= number <= F32_MAX:
        raise invalid(f"{where} must be >= 0 and at most {F32_MAX:.6g} (a 32-bit float), got {number}")
    return number


def _top_p(where: str, value: Any) -> float:
    number = _as_float(where, value)
    if not F32_TINY <= number <= 1:  # 0 means "no top-p" to the engines: a tiny top_p must not turn into it
        raise invalid(f"{where} must be in (0, 1] and at least {F32_TINY:.6g} (a 32-bit float), got {number}")
    return number


def _top_k(where: str, value: Any) -> int:
    number = _vllm_int(where, value)
    if not -1 <= number <= 2**31 - 1:  # SamplingOptions.top_k is an int32
        raise invalid(
            f"{where} must be -1 (disabled), 0 (disabled) or a positive integer up to {2**31 - 1}, "
            f"got {clip(str(number))}"
        )
    return max(number, 0)


def _seed(where: str, value: Any) -> int:
    number = _as_int(where, value)
    if not 0 <= number < 2**64:
        raise invalid(f"{where} must be in [0, 2**64), got {clip(str(number))}")
    return number


def _stop(where: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise invalid(f"{where} must be a string or a list of strings, got {_shown(value)}")
    if any(item == "" for item in items):
        raise invalid(f"{where} must not contain an empty string")
    if len(items) > MAX_STOP_STRINGS:  # each is looked for in every token's text, on the event loop
        raise invalid(f"{where} has {len(items)} strings; at most {MAX_STOP_STRINGS} are accepted")
    return tuple(items)


def _stop_token_ids(where: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid(f"{where} must be a list of token ids, got {_shown(value)}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"{where} has {len(value)} token ids; at most {MAX_STOP_TOKEN_IDS} are accepted")
    ids = tuple(_as_int(f"{where}[{i}]", item) for i, item in enumerate(value))
    for i, token in enumerate(ids):
        if not 0 <= token < 2**32:
            raise invalid(f"{where}[{i}] must be a token id in [0, 2**32), got {clip(str(token))}")
    return ids


def _exactly(expected: Any, name: str) -> Callable[[str, Any], None]:
    """Keys kvmesh accepts only at their neutral value (it cannot honour anything else)."""

    def parse(where: str, value: Any) -> None:
        if value is None:
            return
        number = _as_float(where, value) if not isinstance(expected, str) else value
        if number != expected:
            raise invalid(f"{where}={_shown(value)} is not supported by kvmesh ({name})")

    return parse


def _lora(where: str, value: Any) -> None:
    if value not in (None, ""):
        raise invalid(f"{where}={_shown(value)}: LoRA adapters are not supported by kvmesh")


# key -> (parser, SamplingParams attribute or None for accepted-and-checked-only keys)
SAMPLING_KEYS: dict[str, tuple[Callable[[str, Any], Any], str | None]] = {
    "max_tokens": (_int_at_least(1, lenient=True), "max_tokens"),
    "min_tokens": (_int_at_least(0, lenient=True), "min_tokens"),
    "temperature": (_temperature, "temperature"),
    "top_p": (_top_p, "top_p"),
    "top_k": (_top_k, "top_k"),
    "seed": (_seed, "seed"),
    "stop": (_stop, "stop"),
    "stop_token_ids": (_stop_token_ids, "stop_token_ids"),
    "ignore_eos": (_as_bool, "ignore_eos"),
    "include_stop_str_in_output": (_as_bool, "include_stop_str_in_output"),
    "skip_special_tokens": (_as_bool, "skip_special_tokens"),
    "logprobs": (_int_at_least(0, lenient=True), "logprobs"),
    "stream_interval": (_int_at_least(1, lenient=True), "stream_interval"),
    "n": (_exactly(1, "one completion per request"), None),
    "best_of": (_exactly(1, "one completion per request"), None),
    "presence_penalty": (_exactly(0.0, "no penalties"), None),
    "frequency_penalty": (_exactly(0.0, "no penalties"), None),
    "repetition_penalty": (_exactly(1.0, "no penalties"), None),
    "lora_name": (_lora, None),
}


def _apply_sampling(sampling: SamplingParams, key: str, value: Any, where: str) -> None:
    parser, attr = SAMPLING_KEYS[key]
    if key in ("seed", "max_tokens", "temperature", "top_p", "top_k", "logprobs", "stream_interval") and value is None:
        return  # JSON null: keep the default
    parsed = parser(where, value)
    if attr is not None:
        setattr(sampling, attr, parsed)


def parameter_value(param: pb.InferParameter) -> Any:
    """The Python value of a request parameter (None when unset)."""
    kind = param.WhichOneof("parameter_choice")
    return None if kind is None else getattr(param, kind)


# -- tensors -----------------------------------------------------------------------------------
def _check_datatype(tensor: Tensor) -> None:
    accepted = INPUT_DATATYPES[tensor.name]
    if tensor.datatype not in accepted:
        expected = " or ".join(accepted)
        raise invalid(f"input '{tensor.name}': expected datatype {expected}, got {tensor.datatype}")


def _scalar(tensor: Tensor) -> Any:
    if len(tensor.values) != 1:
        raise invalid(
            f"input '{tensor.name}': expected exactly 1 element, got {len(tensor.values)} (shape {list(tensor.shape)})"
        )
    return tensor.values[0]


def _utf8(tensor: Tensor, value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(
            f"input '{tensor.name}': not valid UTF-8 (byte 0x{value[exc.start]:02x} at offset {exc.start})"
        ) from None


def _parse_messages(tensor: Tensor) -> list[dict[str, Any]]:
    doc = _load_json("messages", _utf8(tensor, _scalar(tensor)))
    if not isinstance(doc, list) or not doc:
        raise invalid('input \'messages\': expected a non-empty JSON list of {"role", "content"} objects')
    for i, message in enumerate(doc):
        if not isinstance(message, dict):
            raise invalid(f"input 'messages': message #{i} is not a JSON object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise invalid(f"input 'messages': message #{i} has no string 'role'")
        # as vLLM renders a template that takes string content: null is "", text parts are joined by "\n"
        content = message.get("content")
        if content is None:
            message["content"] = ""
        elif isinstance(content, list):  # OpenAI content parts: keep the text ones
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(
                        f"input 'messages': message #{i} content part #{j} is not a "
                        '{"type": "text", "text": ...} part'
                    )
                texts.append(part["text"])
            message["content"] = "\n".join(texts)
        elif not isinstance(content, str):
            raise invalid(f"input 'messages': message #{i} 'content' must be a string, a list of text parts or null")
        if role == "assistant" and isinstance(message.get("tool_calls"), list):
            _tool_call_arguments(i, message)
    return doc


def _tool_call_arguments(i: int, message: dict[str, Any]) -> None:
    """As vLLM hands tool calls to a template: ``arguments`` as an object (a JSON string parsed; {} when it
    is no JSON object), and an empty ``tool_calls`` dropped (else "list has no element 0" in the template)."""
    calls = message["tool_calls"]
    if not calls:
        del message["tool_calls"]
        return
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise invalid(f'input \'messages\': message #{i} tool call #{j} is not a {{"type": "function"}} call')
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except ValueError:
                arguments = {}  # in the history, a bad one must not fail every later turn (vLLM's reasoning)
        function["arguments"] = arguments if isinstance(arguments, dict) else {}


def _parse_sampling_json(tensor: Tensor, sampling: SamplingParams) -> None:
    text = _utf8(tensor, _scalar(tensor))
    if not text.strip():
        return
    doc = _load_json("sampling_parameters", text)
    if not isinstance(doc, dict):
        raise invalid("input 'sampling_parameters': expected a JSON object")
    for key, value in doc.items():
        if key not in SAMPLING_KEYS:
            raise invalid(
                f"input 'sampling_parameters': unknown key {clip(key)!r} "
                f"(supported: {', '.join(sorted(SAMPLING_KEYS))})"
            )
        _apply_sampling(sampling, key, value, f"input 'sampling_parameters': '{key}'")


def _worker_id(value: Any) -> int:
    where = f"parameter '{PARAM_WORKER_ID}'"
    if isinstance(value, str):
        try:
            number = int(value.strip(), 0)
        except ValueError:
            raise invalid(f"{where} must be an engine id (integer, or 0x-prefixed hex), got {clip(value)!r}") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        raise invalid(f"{where} must be an engine id (integer), got {clip(value)!r}")
    if not 0 <= number < 2**64:
        raise invalid(f"{where} must be in [0, 2**64), got {clip(str(number))}")
    return number


def _apply_parameters(params: Mapping[str, pb.InferParameter], req: LlmRequest) -> None:
    if len(params) > MAX_PARAMETERS:
        raise invalid(f"the request has {len(params)} parameters; at most {MAX_PARAMETERS} are accepted")
    for key, param in params.items():
        value = parameter_value(param)
        if isinstance(value, str) and len(value) > MAX_PARAMETER_STRING_BYTES and key not in _RESERVED_PARAMS:
            raise invalid(
                f"parameter '{clip(key)}': a string of {len(value)} characters is over the limit of "
                f"{MAX_PARAMETER_STRING_BYTES}"
            )
        if key == PARAM_EMPTY_FINAL:
            req.empty_final = _as_bool(f"parameter '{key}'", value)
        elif key == PARAM_WORKER_ID:
            req.pinned_engine_id = _worker_id(value)
        elif key == PARAM_ROUTER_MODE:
            mode = ROUTER_MODES.get(str(value).strip().lower()) if isinstance(value, str) else None
            if mode is None:
                raise invalid(f"parameter '{key}' must be one of {', '.join(ROUTER_MODES)}, got {clip(value)!r}")
            req.router_mode = mode
        elif key == PARAM_ROUTER_POLICY:
            if not isinstance(value, str) or not value.strip() or len(value.strip()) > MAX_ECHO_CHARS:
                raise invalid(
                    f"parameter '{key}' must be a cost policy name such as 'affinity' or 'dynamo' "
                    f"(at most {MAX_ECHO_CHARS} characters), got {clip(value)!r}"
                )
            req.router_policy = value.strip()
        elif key in SAMPLING_KEYS:
            _apply_sampling(req.sampling, key, value, f"parameter '{key}'")
        # everything else (Triton's reserved keys, unknown keys) is not ours to judge


def parse_llm_request(
    request: pb.ModelInferRequest, *, unary: bool = False, context_length: int = 0, model: str = ""
) -> LlmRequest:
    """Validate a ModelInferRequest against the LLM tensor contract.

    ``unary`` is true for ModelInfer, which answers with exactly one response and so refuses
    ``stream=true``. ``context_length`` (0: unknown) of ``model`` sets the prompt's size limits,
    which are checked before the tensors are decoded.
    """
    if len(request.outputs) > MAX_REQUESTED_OUTPUTS:
        raise invalid(f"the request names {len(request.outputs)} outputs; at most {MAX_REQUESTED_OUTPUTS} are accepted")
    if len(request.id) > MAX_ID_CHARS:
        raise invalid(f"the request id has {len(request.id)} characters; at most {MAX_ID_CHARS} are accepted")
    tensors = decode_inputs(request, input_limits(context_length, model))
    for tensor in tensors.values():
        _check_datatype(tensor)
    req = LlmRequest(model=request.model_name, client_id=request.id)

    prompts = [name for name in PROMPT_INPUTS if name in tensors]
    if not prompts:
        raise invalid("missing input: one of 'text_input', 'input_ids' or 'messages' is required")
    if len(prompts) > 1:
        raise invalid(f"inputs {' and '.join(repr(p) for p in prompts)} are exclusive: send exactly one prompt")
    prompt = tensors[prompts[0]]
    if prompt.name == "text_input":
        if len(prompt.values) != 1:
            raise invalid(
                f"input 'text_input': expected exactly one prompt, got {len(prompt.values)} elements "
                "(batching is not supported; send one request per prompt)"
            )
        req.text = _utf8(prompt, prompt.values[0])
    elif prompt.name == "input_ids":
        if len(prompt.shape) > 2 or (len(prompt.shape) == 2 and prompt.shape[0] != 1):
            raise invalid(f"input 'input_ids': expected shape [N] or [1, N], got {list(prompt.shape)}")
        # Raw INT32/INT64 (what tritonclient and the replay send) is checked as the array it arrived as.
        ids = prompt.array if prompt.array is not None else np.array(prompt.values, dtype=np.int64)
        if not ids.size:
            raise invalid("input 'input_ids': the prompt is empty")
        if ids.min() < 0 or ids.max() > _MAX_TOKEN_ID:
            i = int(np.argmax((ids < 0) | (ids > _MAX_TOKEN_ID)))
            why = "negative" if ids[i] < 0 else f"above the largest token id {_MAX_TOKEN_ID}"
            raise invalid(f"input 'input_ids': token id {int(ids[i])} at index {i} is {why}")
        req.input_ids = PromptTokens.of(ids)
    else:
        req.messages = _parse_messages(prompt)

    stream = [bool(_scalar(tensors[name])) for name in ("stream", "streaming") if name in tensors]
    if len(stream) == 2 and stream[0] != stream[1]:
        raise invalid("inputs 'stream' and 'streaming' disagree; send one of them")
    req.stream = bool(stream and stream[0])
    if req.stream and unary:
        raise invalid("input 'stream': true needs ModelStreamInfer (ModelInfer returns exactly one response)")

    exclude = tensors.get("exclude_input_in_output")
    if exclude is not None:
        req.exclude_input = bool(_scalar(exclude))
        if req.stream and not req.exclude_input:
            raise invalid(
                "input 'exclude_input_in_output': false is not allowed with stream=true "
                "(streamed responses never repeat the prompt)"
            )
    else:
        req.exclude_input = req.stream
    req.flags = frozenset(name for name in OUTPUT_FLAGS.values() if name in tensors and _scalar(tensors[name]))

    _apply_parameters(request.parameters, req)
    if "sampling_parameters" in tensors:
        _parse_sampling_json(tensors["sampling_parameters"], req.sampling)
    if "max_tokens" in tensors:
        req.sampling.max_tokens = _int_at_least(1)("input 'max_tokens'", _scalar(tensors["max_tokens"]))
    if "min_length" in tensors:
        req.sampling.min_tokens = _int_at_least(0)("input 'min_length'", _scalar(tensors["min_length"]))
    if req.sampling.max_tokens is not None and req.sampling.min_tokens > req.sampling.max_tokens:
        raise invalid(f"min_tokens ({req.sampling.min_tokens}) must not exceed max_tokens ({req.sampling.max_tokens})")

    if req.router_mode == router_pb2.ROUTER_MODE_DIRECT and req.pinned_engine_id is None:
        raise invalid(f"parameter '{PARAM_ROUTER_MODE}': direct needs parameter '{PARAM_WORKER_ID}'")
    if req.pinned_engine_id is not None:
        req.router_mode = router_pb2.ROUTER_MODE_DIRECT

    if request.outputs:
        names = []
        for out in request.outputs:
            if out.name not in OUTPUTS:
                raise invalid(
                    f"output '{clip(out.name)}' is not an output of this model (outputs: {', '.join(OUTPUTS)})"
                )
            # What Triton would do to an output and kvmesh cannot: refused, never silently ignored.
            if out.parameters.get("classification", _NO_PARAMETER).int64_param:
                raise invalid(f"output '{out.name}': classification (class_count) is not supported by this model")
            if SHARED_MEMORY_REGION in out.parameters:
                raise invalid(
                    f"output '{out.name}': kvmesh writes no shared memory (registering one is UNIMPLEMENTED); "
                    "take the output from the response"
                )
            names.append(out.name)
        req.requested_outputs = tuple(names)
    return req
