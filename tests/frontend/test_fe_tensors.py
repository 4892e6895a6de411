"""The KServe tensor codec: typed and raw inputs decode to the same values; every error names the tensor."""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest
from inference import grpc_service_pb2 as pb
from kvmesh_frontend.errors import FrontendError
from kvmesh_frontend.tensors import (
    add_output,
    decode_inputs,
    encode_bytes,
    encode_numbers,
    encode_one_bytes,
    output_values,
)

CASES = [
    ("BYTES", [b"hello", b"", "héllo".encode()], "bytes_contents"),
    ("BOOL", [True, False, True], "bool_contents"),
    ("INT8", [-128, 0, 127], "int_contents"),
    ("INT16", [-32768, 5, 32767], "int_contents"),
    ("INT32", [-(2**31), 7, 2**31 - 1], "int_contents"),
    ("INT64", [-(2**63), 9, 2**63 - 1], "int64_contents"),
    ("UINT8", [0, 255], "uint_contents"),
    ("UINT16", [0, 65535], "uint_contents"),
    ("UINT32", [0, 2**32 - 1], "uint_contents"),
    ("UINT64", [0, 2**64 - 1], "uint64_contents"),
    ("FP32", [1.5, -2.25], "fp32_contents"),
    ("FP64", [1e300, -0.125], "fp64_contents"),
]
NUMPY = {
    "INT8": "<i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "UINT8": "<u1", "UINT16": "<u2",
    "UINT32": "<u4", "UINT64": "<u8", "FP32": "<f4", "FP64": "<f8",
}  # fmt: skip


def raw_of(datatype: str, values: list) -> bytes:
    if datatype == "BYTES":
        return encode_bytes(values)
    if datatype == "BOOL":
        return bytes(values)
    return np.asarray(values, dtype=NUMPY[datatype]).tobytes()


def typed_request(datatype: str, values: list, field: str, name: str = "x") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest()
    tensor = request.inputs.add(name=name, datatype=datatype, shape=[len(values)])
    getattr(tensor.contents, field).extend(values)
    return request


def raw_request(datatype: str, values: list, name: str = "x", shape: list[int] | None = None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest()
    request.inputs.add(name=name, datatype=datatype, shape=shape if shape is not None else [len(values)])
    request.raw_input_contents.append(raw_of(datatype, values))
    return request


def error_of(request: pb.ModelInferRequest) -> str:
    with pytest.raises(FrontendError) as info:
        decode_inputs(request)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.message


@pytest.mark.parametrize(("datatype", "values", "field"), CASES, ids=[c[0] for c in CASES])
def test_typed_and_raw_decode_to_the_same_values(datatype: str, values: list, field: str) -> None:
    typed = decode_inputs(typed_request(datatype, values, field))["x"]
    raw = decode_inputs(raw_request(datatype, values))["x"]
    assert typed.values == values
    assert raw.values == values
    assert typed.shape == raw.shape == (len(values),)


def test_half_precision_is_raw_only() -> None:
    values = [1.5, -0.25]
    assert decode_inputs(_fp16(values))["x"].values == values
    bf16 = pb.ModelInferRequest()
    bf16.inputs.add(name="x", datatype="BF16", shape=[2])
    bits = (np.asarray(values, dtype="<f4").view("<u4") >> 16).astype("<u2")
    bf16.raw_input_contents.append(bits.tobytes())
    assert decode_inputs(bf16)["x"].values == values
    msg = error_of(typed_request("FP16", [], "fp32_contents"))
    assert "input 'x'" in msg and "raw_input_contents" in msg


def _fp16(values: list[float]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest()
    request.inputs.add(name="x", datatype="FP16", shape=[len(values)])
    request.raw_input_contents.append(np.asarray(values, dtype="<f2").tobytes())
    return request


def test_multi_dimensional_shapes_and_scalars() -> None:
    request = raw_request("INT32", [1, 2, 3, 4, 5, 6], shape=[2, 3])
    assert decode_inputs(request)["x"].shape == (2, 3)
    scalar = raw_request("INT64", [42], shape=[])
    assert decode_inputs(scalar)["x"].values == [42]


def test_several_inputs_keep_their_order_in_raw_form() -> None:
    request = pb.ModelInferRequest()
    request.inputs.add(name="a", datatype="BYTES", shape=[1])
    request.inputs.add(name="b", datatype="BOOL", shape=[1])
    request.raw_input_contents.extend([encode_bytes([b"text"]), b"\x01"])
    decoded = decode_inputs(request)
    assert decoded["a"].values == [b"text"]
    assert decoded["b"].values == [True]


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: typed_request("INT32", [1, 2], "int_contents", name=""), "input #0 has no name"),
        (lambda: typed_request("TEXT", [b"x"], "bytes_contents"), "input 'x': unknown datatype 'TEXT'"),
        (lambda: raw_request("INT32", [1, 2], shape=[3]), "input 'x': shape [3] holds 3 element(s) but 2 were sent"),
        (lambda: raw_request("INT32", [1], shape=[-1]), "input 'x': shape [-1] has a negative dimension"),
        (
            lambda: _wrong_field(),
            "input 'x': datatype INT32 goes in contents.int_contents, not contents.int64_contents",
        ),
        (lambda: _duplicate(), "input 'x' is given twice"),
        (lambda: _raw_count_mismatch(), "raw_input_contents has 1 entries but the request has 2 inputs"),
        (lambda: _mixed(), "input 'x': typed contents and raw_input_contents cannot be mixed"),
        (lambda: _raw_bad_size(), "input 'x': raw data of 7 bytes is not a multiple of the 4-byte INT32 element size"),
        (lambda: _raw_bytes_cut_prefix(), "input 'x': raw BYTES element #1 is cut inside its 4-byte length prefix"),
        (lambda: _raw_bytes_overrun(), "input 'x': raw BYTES element #0 declares 10 bytes but only 3 remain"),
        (lambda: _typed_count(), "input 'x': shape [1] holds 1 element(s) but 2 were sent"),
    ],
)
def test_errors_name_the_tensor(build, expected: str) -> None:
    assert expected in error_of(build())


def _wrong_field() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest()
    request.inputs.add(name="x", datatype="INT32", shape=[1]).contents.int64_contents.append(1)
    return request


def _duplicate() -> pb.ModelInferRequest:
    request = typed_request("INT32", [1], "int_contents")
    request.inputs.add(name="x", datatype="INT32", shape=[1]).contents.int_contents.append(2)
    return request


def _raw_count_mismatch() -> pb.ModelInferRequest:
    request = raw_request("INT32", [1])
    request.inputs.add(name="y", datatype="INT32", shape=[1])
    return request


def _mixed() -> pb.ModelInferRequest:
    request = raw_request("INT32", [1])
    request.inputs[0].contents.int_contents.append(1)
    return request


def _raw_bad_size() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest()
    request.inputs.add(name="x", datatype="INT32", shape=[2])
    request.raw_input_contents.append(b"\x00" * 7)
    return request


def _raw_bytes_cut_prefix() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest()
    request.inputs.add(name="x", datatype="BYTES", shape=[2])
    request.raw_input_contents.append(encode_bytes([b"ab"]) + b"\x01\x00")
    return request


def _raw_bytes_overrun() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest()
    request.inputs.add(name="x", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", 10) + b"abc")
    return request


def _typed_count() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest()
    request.inputs.add(name="x", datatype="BYTES", shape=[1]).contents.bytes_contents.extend([b"a", b"b"])
    return request


def test_outputs_are_raw_and_read_back() -> None:
    response = pb.ModelInferResponse()
    add_output(response, "text_output", "BYTES", (1,), encode_one_bytes("日本".encode()))
    add_output(response, "num_output_tokens", "UINT32", (1,), encode_numbers("UINT32", [7]))
    add_output(response, "flags", "BOOL", (2,), encode_numbers("BOOL", [True, False]))
    assert not response.outputs[0].HasField("contents")
    assert output_values(response, "text_output") == ["日本".encode()]
    assert output_values(response, "num_output_tokens") == [7]
    assert output_values(response, "flags") == [True, False]
    assert output_values(response, "missing") is None
    # tritonclient's wire form for BYTES: 4-byte little-endian length, then the bytes
    assert response.raw_output_contents[0] == struct.pack("<I", 6) + "日本".encode()
