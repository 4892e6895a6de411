"""The KServe v2 tensor codec: request inputs to Python values, Python values to response outputs.

Inputs arrive either as typed ``contents`` (one repeated field per datatype family) or as
``raw_input_contents`` (one little-endian byte string per input, in the order of ``inputs``; BYTES
elements are each a 4-byte little-endian length followed by the bytes). A request uses one form
for every input, never both. Every error names the tensor and says what is wrong, and is an
INVALID_ARGUMENT :class:`~kvmesh_frontend.errors.FrontendError`.

Sizes are checked before anything is decoded (:class:`TensorLimit`): the element count from the
shape, the length of the typed contents and the byte length of raw data are all O(1) to read, while
decoding 16M elements into Python objects holds the event loop (and so every other stream) for
seconds.

Outputs are always written as ``raw_output_contents`` (what Triton itself does and what
``tritonclient``'s ``InferResult.as_numpy`` reads for every datatype).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from inference import grpc_service_pb2 as pb

from kvmesh_frontend.errors import clip, invalid

# Element size in bytes of each fixed-size datatype (BYTES is variable).
ELEMENT_SIZE: dict[str, int] = {
    "BOOL": 1,
    "UINT8": 1,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "FP32": 4,
    "FP64": 8,
    "BF16": 2,
}
DATATYPES = frozenset([*ELEMENT_SIZE, "BYTES"])

# The typed-contents field each datatype must use.
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

_NUMPY: dict[str, str] = {
    "UINT8": "<u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "INT8": "<i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
}

_LEN = struct.Struct("<I")


class Tensor:
    """One decoded input: its elements flattened in row-major order.

    ``values`` holds them as Python values. A fixed-size numeric tensor sent raw also has ``array``, a
    read-only numpy view of the bytes as sent, and its ``values`` are built from that on first use: an
    input only read as an array (the ``input_ids`` prompt: 14k tokens would be 14k Python ints, ~0.2 ms
    to make and as much to scan) never becomes a Python object per element.
    """

    __slots__ = ("_values", "array", "datatype", "name", "shape")

    def __init__(
        self,
        name: str,
        datatype: str,
        shape: tuple[int, ...],
        values: list[Any] | None = None,
        array: np.ndarray | None = None,
    ) -> None:
        if (values is None) == (array is None):
            raise ValueError("a Tensor holds either values or an array")
        self.name = name
        self.datatype = datatype
        self.shape = shape
        self.array = array
        self._values = values

    @property
    def values(self) -> list[Any]:
        if self._values is None:
            assert self.array is not None  # one of the two is always set
            self._values = self.array.tolist()
        return self._values

    def __len__(self) -> int:
        return self.array.size if self.array is not None else len(self.values)


@dataclass(frozen=True, slots=True)
class TensorLimit:
    """The most one input may hold, checked before it is decoded.

    ``max_bytes`` bounds the raw data (BYTES: the elements with their 4-byte prefixes) or, for
    typed contents, the elements' total size; ``why`` ends the error message and says what the
    limit comes from, so the client knows what to change.
    """

    max_elements: int
    max_bytes: int
    why: str = ""

    def check_count(self, name: str, count: int) -> None:
        if count > self.max_elements:
            raise invalid(f"input '{name}': {count} elements is over the limit of {self.max_elements}{self._why()}")

    def check_bytes(self, name: str, size: int) -> None:
        if size > self.max_bytes:
            raise invalid(f"input '{name}': {size} bytes is over the limit of {self.max_bytes} bytes{self._why()}")

    def _why(self) -> str:
        return f" ({self.why})" if self.why else ""


def element_count(name: str, shape: Sequence[int]) -> int:
    """Elements a shape holds; negative dimensions are an error (an empty shape is a scalar)."""
    for dim in shape:
        if dim < 0:
            raise invalid(f"input '{name}': shape {list(shape)} has a negative dimension")
    return math.prod(shape)


SHARED_MEMORY_REGION = "shared_memory_region"  # KServe's parameter naming an input's or output's region


def decode_inputs(request: pb.ModelInferRequest, limits: Mapping[str, TensorLimit] | None = None) -> dict[str, Tensor]:
    """Decode every input of a request (typed or raw), checking datatypes, shapes and sizes.

    With ``limits``, an input whose name is not in it is refused, and every input is held to its
    limit before its data is read.
    """
    inputs = request.inputs
    raw = request.raw_input_contents
    for tensor in inputs:  # before the count below, which such an input breaks: say what is wrong
        if SHARED_MEMORY_REGION in tensor.parameters:
            raise invalid(
                f"input '{clip(tensor.name)}' is in a shared memory region: kvmesh takes no shared memory "
                "(registering one is UNIMPLEMENTED); send the data in the request"
            )
    if raw and len(raw) != len(inputs):
        raise invalid(
            f"raw_input_contents has {len(raw)} entries but the request has {len(inputs)} inputs; "
            "when raw_input_contents is used every input must be in it, in the order of 'inputs'"
        )
    out: dict[str, Tensor] = {}
    for index, tensor in enumerate(inputs):
        name = tensor.name
        if not name:
            raise invalid(f"input #{index} has no name")
        limit = None
        if limits is not None:
            limit = limits.get(name)
            if limit is None:
                raise invalid(f"input '{clip(name)}' is not an input of this model (inputs: {', '.join(limits)})")
        if name in out:
            raise invalid(f"input '{clip(name)}' is given twice")
        datatype = tensor.datatype
        if datatype not in DATATYPES:
            raise invalid(f"input '{clip(name)}': unknown datatype {clip(datatype)!r}")
        if len(tensor.shape) > 8:
            raise invalid(f"input '{clip(name)}': shape has {len(tensor.shape)} dimensions; at most 8 are accepted")
        shape = tuple(tensor.shape)
        count = element_count(name, shape)
        if limit is not None:
            limit.check_count(name, count)
        if raw:
            if tensor.HasField("contents") and tensor.contents.ListFields():
                raise invalid(f"input '{name}': typed contents and raw_input_contents cannot be mixed")
            if limit is not None:
                limit.check_bytes(name, len(raw[index]))
            if datatype in _NUMPY:
                decoded = Tensor(name, datatype, shape, array=decode_raw_array(name, datatype, raw[index]))
            else:
                decoded = Tensor(name, datatype, shape, decode_raw(name, datatype, raw[index], max_elements=count))
        else:
            decoded = Tensor(name, datatype, shape, _decode_typed(name, datatype, tensor.contents, limit))
        if len(decoded) != count:
            raise invalid(f"input '{name}': shape {list(shape)} holds {count} element(s) but {len(decoded)} were sent")
        out[name] = decoded
    return out


def _decode_typed(
    name: str, datatype: str, contents: pb.InferTensorContents, limit: TensorLimit | None = None
) -> list[Any]:
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise invalid(f"input '{name}': datatype {datatype} must be sent in raw_input_contents")
    for descriptor, _value in contents.ListFields():
        if descriptor.name != field:
            raise invalid(
                f"input '{name}': datatype {datatype} goes in contents.{field}, not contents.{descriptor.name}"
            )
    elements = getattr(contents, field)
    if limit is not None:
        limit.check_count(name, len(elements))
        if datatype == "BYTES":
            limit.check_bytes(name, sum(len(item) + 4 for item in elements))
        else:
            limit.check_bytes(name, len(elements) * ELEMENT_SIZE[datatype])
    return list(elements)


def decode_raw(name: str, datatype: str, data: bytes, max_elements: int | None = None) -> list[Any]:
    """Elements of one raw tensor (little-endian; BYTES length-prefixed with no trailing bytes).

    ``max_elements`` (the count the shape declares) stops a BYTES decode as soon as the data holds
    more elements than that, instead of decoding millions of them to find out.
    """
    if datatype == "BYTES":
        return decode_bytes_raw(name, data, max_elements)
    if datatype in _NUMPY:
        values: list[Any] = decode_raw_array(name, datatype, data).tolist()
        return values
    _check_whole_elements(name, datatype, data)
    if datatype == "BOOL":
        return [b != 0 for b in data]
    # BF16
    halves = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
    floats: list[float] = halves.view(np.float32).tolist()  # numpy types tolist() as Any
    return floats


def decode_raw_array(name: str, datatype: str, data: bytes) -> np.ndarray:
    """A raw tensor of a numpy-native datatype (every fixed-size one but BOOL and BF16) as a read-only view."""
    _check_whole_elements(name, datatype, data)
    return np.frombuffer(data, dtype=_NUMPY[datatype])


def _check_whole_elements(name: str, datatype: str, data: bytes) -> None:
    size = ELEMENT_SIZE[datatype]
    if len(data) % size:
        raise invalid(
            f"input '{name}': raw data of {len(data)} bytes is not a multiple of "
            f"the {size}-byte {datatype} element size"
        )


def decode_bytes_raw(name: str, data: bytes, max_elements: int | None = None) -> list[bytes]:
    items: list[bytes] = []
    pos, end = 0, len(data)
    unpack = _LEN.unpack_from
    while pos < end:
        if max_elements is not None and len(items) == max_elements:
            raise invalid(
                f"input '{name}': raw BYTES data holds more than the {max_elements} element(s) its shape declares"
            )
        if end - pos < 4:
            raise invalid(f"input '{name}': raw BYTES element #{len(items)} is cut inside its 4-byte length prefix")
        (length,) = unpack(data, pos)
        pos += 4
        if length > end - pos:
            raise invalid(
                f"input '{name}': raw BYTES element #{len(items)} declares {length} bytes but only {end - pos} remain"
            )
        items.append(data[pos : pos + length])
        pos += length
    return items


# -- outputs -----------------------------------------------------------------------------------
def encode_bytes(items: Iterable[bytes]) -> bytes:
    """Raw BYTES tensor: each element as a 4-byte little-endian length, then the bytes."""
    pack = _LEN.pack
    return b"".join(pack(len(item)) + item for item in items)


def encode_one_bytes(item: bytes) -> bytes:
    return _LEN.pack(len(item)) + item


def encode_numbers(datatype: str, values: Sequence[int | float]) -> bytes:
    if datatype == "BOOL":
        return bytes(1 if v else 0 for v in values)
    return np.asarray(values, dtype=_NUMPY[datatype]).tobytes()


def add_output(response: pb.ModelInferResponse, name: str, datatype: str, shape: Sequence[int], raw: bytes) -> None:
    """Append one output tensor (raw form) to a response."""
    response.outputs.add(name=name, datatype=datatype, shape=shape)
    response.raw_output_contents.append(raw)


def output_values(response: pb.ModelInferResponse, name: str) -> list[Any] | None:
    """Decode one output of a response (tests and the benchmark read responses with it)."""
    for index, output in enumerate(response.outputs):
        if output.name != name:
            continue
        if index < len(response.raw_output_contents):
            return decode_raw(name, output.datatype, response.raw_output_contents[index])
        return _decode_typed(name, output.datatype, output.contents)
    return None
