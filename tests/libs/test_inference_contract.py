"""protos/inference is wire-compatible with the KServe v2 / Triton contract stock tritonclient speaks.

Our protos and tritonclient's generated modules both declare proto package ``inference``, so they
cannot share one process's default descriptor pool (duplicate symbols). Nothing here imports
either: our side is parsed from the .proto sources with ``grpc_tools.protoc --descriptor_set_out``
(and, separately, read from our generated modules in a subprocess); tritonclient's side is its
serialized FileDescriptorProto, printed by a subprocess. The test compares plain
``FileDescriptorProto`` messages.

Rule: every message, field, enum value and RPC that tritonclient has must exist in ours with the
same number, type, label, type name, oneof and streaming flags. Extras on our side are reported as
warnings (wire-compatible, but a sign of drift).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

OUR_FILES = {  # our file (relative to protos/) -> tritonclient module with the same contract
    "inference/grpc_service.proto": "tritonclient.grpc.service_pb2",
    "inference/model_config.proto": "tritonclient.grpc.model_config_pb2",
}
OUR_MODULES = {
    "inference/grpc_service.proto": "inference.grpc_service_pb2",
    "inference/model_config.proto": "inference.model_config_pb2",
}

# The RPCs the frontend must route (the rest must exist too, answered UNIMPLEMENTED).
CORE_RPCS = {
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    "ModelStreamInfer",
    "ModelConfig",
}

_F = descriptor_pb2.FieldDescriptorProto


def _protos_root() -> Path:
    """protos/ next to tests/ (the source tree under pytest, the runfiles tree under Bazel)."""
    here = Path(os.path.abspath(__file__))  # not resolved: under Bazel, stay inside runfiles
    for parent in here.parents:
        if (parent / "protos" / "inference" / "grpc_service.proto").is_file():
            return parent / "protos"
    pytest.fail(f"protos/inference/grpc_service.proto not found above {here}")


def _serialized_descriptor(module: str, *, pythonpath: list[str] | None = None) -> bytes:
    """FileDescriptorProto bytes of a generated module, read in a fresh interpreter."""
    code = (
        "import importlib, sys\n"
        f"m = importlib.import_module({module!r})\n"
        "sys.stdout.write(m.DESCRIPTOR.serialized_pb.hex())\n"
    )
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in pythonpath if p)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    if proc.returncode != 0:
        raise ImportError(f"importing {module} failed:\n{proc.stderr.strip()}")
    return bytes.fromhex(proc.stdout)


@pytest.fixture(scope="module")
def ours_from_source(tmp_path_factory) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """Our .proto files, parsed by protoc (with comments: source_code_info)."""
    root = _protos_root()
    out = tmp_path_factory.mktemp("descriptors") / "inference.pb"
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{root}",
        f"--descriptor_set_out={out}",
        "--include_source_info",
        *(str(root / f) for f in OUR_FILES),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"protoc failed on our protos:\n{proc.stderr}"
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    files = {f.name: f for f in fds.file}
    assert set(files) == set(OUR_FILES)
    return files


@pytest.fixture(scope="module")
def triton() -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """tritonclient's descriptors, keyed by OUR file name."""
    files = {}
    for ours, module in OUR_FILES.items():
        try:
            raw = _serialized_descriptor(module)
        except ImportError as exc:
            if "No module named 'tritonclient" in str(exc):
                pytest.skip("tritonclient[grpc] is not installed; it is the reference for this test")
            raise
        files[ours] = descriptor_pb2.FileDescriptorProto.FromString(raw)
    return files


# --------------------------------------------------------------------------- comparison helpers


def _messages(fd: descriptor_pb2.FileDescriptorProto) -> dict[str, descriptor_pb2.DescriptorProto]:
    """Every message (nested ones too, map entries included) by full name."""
    out: dict[str, descriptor_pb2.DescriptorProto] = {}

    def walk(msg: descriptor_pb2.DescriptorProto, prefix: str) -> None:
        name = f"{prefix}.{msg.name}"
        out[name] = msg
        for nested in msg.nested_type:
            walk(nested, name)

    for msg in fd.message_type:
        walk(msg, f".{fd.package}")
    return out


def _enums(fd: descriptor_pb2.FileDescriptorProto) -> dict[str, descriptor_pb2.EnumDescriptorProto]:
    out = {f".{fd.package}.{e.name}": e for e in fd.enum_type}
    for name, msg in _messages(fd).items():
        out.update({f"{name}.{e.name}": e for e in msg.enum_type})
    return out


def _field_signature(msg: descriptor_pb2.DescriptorProto, field: descriptor_pb2.FieldDescriptorProto) -> dict:
    oneof = None
    if field.HasField("oneof_index") and not field.proto3_optional:
        oneof = msg.oneof_decl[field.oneof_index].name
    return {
        "number": field.number,
        "type": _F.Type.Name(field.type),
        "label": _F.Label.Name(field.label),
        "type_name": field.type_name,
        "oneof": oneof,
        "proto3_optional": field.proto3_optional,
        "packed": field.options.packed if field.options.HasField("packed") else None,
    }


def _compare(ours: descriptor_pb2.FileDescriptorProto, ref: descriptor_pb2.FileDescriptorProto) -> tuple[list, list]:
    """(problems, extras): what tritonclient has that ours lacks or differs in, and what only we have."""
    problems: list[str] = []
    extras: list[str] = []
    if (ours.package, ours.syntax) != (ref.package, ref.syntax):
        problems.append(f"package/syntax {ours.package}/{ours.syntax} != {ref.package}/{ref.syntax}")

    our_msgs, ref_msgs = _messages(ours), _messages(ref)
    for name, ref_msg in ref_msgs.items():
        our_msg = our_msgs.get(name)
        if our_msg is None:
            problems.append(f"message {name} missing")
            continue
        if our_msg.options.map_entry != ref_msg.options.map_entry:
            problems.append(f"message {name}: map_entry {our_msg.options.map_entry} != {ref_msg.options.map_entry}")
        our_fields = {f.name: f for f in our_msg.field}
        for ref_field in ref_msg.field:
            our_field = our_fields.pop(ref_field.name, None)
            if our_field is None:
                problems.append(f"field {name}.{ref_field.name} = {ref_field.number} missing")
                continue
            want, got = _field_signature(ref_msg, ref_field), _field_signature(our_msg, our_field)
            if want != got:
                diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
                problems.append(f"field {name}.{ref_field.name}: (ours, tritonclient) differ: {diff}")
        extras += [f"field {name}.{f.name} = {f.number}" for f in our_fields.values()]
        if {o.name for o in our_msg.oneof_decl} != {o.name for o in ref_msg.oneof_decl}:
            problems.append(
                f"message {name}: oneofs {[o.name for o in our_msg.oneof_decl]} "
                f"!= {[o.name for o in ref_msg.oneof_decl]}"
            )
        reserved = {(r.start, r.end) for r in ref_msg.reserved_range} - {
            (r.start, r.end) for r in our_msg.reserved_range
        }
        if reserved:
            problems.append(f"message {name}: reserved ranges {sorted(reserved)} missing")
    extras += [f"message {name}" for name in our_msgs.keys() - ref_msgs.keys()]

    our_enums, ref_enums = _enums(ours), _enums(ref)
    for name, ref_enum in ref_enums.items():
        our_enum = our_enums.get(name)
        if our_enum is None:
            problems.append(f"enum {name} missing")
            continue
        our_values = {v.name: v.number for v in our_enum.value}
        for value in ref_enum.value:
            if our_values.pop(value.name, None) != value.number:
                problems.append(f"enum value {name}.{value.name} = {value.number} missing or renumbered")
        extras += [f"enum value {name}.{v} = {n}" for v, n in our_values.items()]
    extras += [f"enum {name}" for name in our_enums.keys() - ref_enums.keys()]

    our_services = {s.name: s for s in ours.service}
    for ref_service in ref.service:
        our_service = our_services.pop(ref_service.name, None)
        if our_service is None:
            problems.append(f"service {ref_service.name} missing")
            continue
        our_methods = {m.name: m for m in our_service.method}
        for ref_method in ref_service.method:
            our_method = our_methods.pop(ref_method.name, None)
            if our_method is None:
                problems.append(f"rpc {ref_service.name}.{ref_method.name} missing")
                continue
            for attr in ("input_type", "output_type", "client_streaming", "server_streaming"):
                if getattr(our_method, attr) != getattr(ref_method, attr):
                    problems.append(
                        f"rpc {ref_service.name}.{ref_method.name}: {attr} "
                        f"{getattr(our_method, attr)!r} != {getattr(ref_method, attr)!r}"
                    )
        # An RPC only we have would reach a stock Triton server as UNIMPLEMENTED: treat as a problem.
        problems += [f"rpc {ref_service.name}.{m} is not in tritonclient" for m in our_methods]
    problems += [f"service {s} is not in tritonclient" for s in our_services]
    return problems, extras


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("our_file", sorted(OUR_FILES))
def test_every_tritonclient_element_exists_with_the_same_wire_shape(our_file, ours_from_source, triton):
    problems, extras = _compare(ours_from_source[our_file], triton[our_file])
    assert not problems, f"{our_file} is not wire-compatible with {OUR_FILES[our_file]}:\n  " + "\n  ".join(problems)
    if extras:
        warnings.warn(f"{our_file} has elements tritonclient lacks: {extras}", stacklevel=1)


def test_service_has_the_core_and_triton_rpcs_with_streaming_flags(ours_from_source, triton):
    ours = ours_from_source["inference/grpc_service.proto"]
    assert [s.name for s in ours.service] == ["GRPCInferenceService"]
    methods = {m.name: m for m in ours.service[0].method}
    assert set(methods) == {m.name for m in triton["inference/grpc_service.proto"].service[0].method}
    assert set(methods) >= CORE_RPCS
    stream = methods["ModelStreamInfer"]
    assert (stream.client_streaming, stream.server_streaming) == (True, True)
    assert (stream.input_type, stream.output_type) == (
        ".inference.ModelInferRequest",
        ".inference.ModelStreamInferResponse",
    )
    assert not any(m.client_streaming or m.server_streaming for n, m in methods.items() if n != "ModelStreamInfer")


def test_decoupled_and_stream_error_fields(ours_from_source):
    """The fields perf_analyzer / genai-perf rely on for decoupled LLM streaming, spelled out."""
    cfg = _messages(ours_from_source["inference/model_config.proto"])
    svc = _messages(ours_from_source["inference/grpc_service.proto"])
    decoupled = {f.name: f for f in cfg[".inference.ModelTransactionPolicy"].field}["decoupled"]
    assert (decoupled.number, decoupled.type) == (1, _F.TYPE_BOOL)
    model_config = {f.name: f.number for f in cfg[".inference.ModelConfig"].field}
    assert {
        k: model_config[k]
        for k in (
            "name",
            "platform",
            "backend",
            "max_batch_size",
            "input",
            "output",
            "model_transaction_policy",
            "parameters",
        )
    } == {
        "name": 1,
        "platform": 2,
        "backend": 17,
        "max_batch_size": 4,
        "input": 5,
        "output": 6,
        "model_transaction_policy": 19,
        "parameters": 14,
    }
    stream_response = {f.name: (f.number, f.type_name) for f in svc[".inference.ModelStreamInferResponse"].field}
    assert stream_response == {"error_message": (1, ""), "infer_response": (2, ".inference.ModelInferResponse")}


def _uncommented(fd: descriptor_pb2.FileDescriptorProto) -> list[str]:
    """Elements without a leading comment (what buf's COMMENT_* rules enforce), from source info."""
    commented = {tuple(loc.path) for loc in fd.source_code_info.location if loc.leading_comments.strip()}
    missing: list[str] = []

    def need(path: tuple[int, ...], what: str) -> None:
        if path not in commented:
            missing.append(what)

    def enum(e: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...], name: str) -> None:
        need(path, f"enum {name}")
        for i, v in enumerate(e.value):
            need((*path, 2, i), f"enum value {name}.{v.name}")

    def message(m: descriptor_pb2.DescriptorProto, path: tuple[int, ...], name: str) -> None:
        need(path, f"message {name}")
        for i, f in enumerate(m.field):
            need((*path, 2, i), f"field {name}.{f.name}")
        for i, n in enumerate(m.nested_type):
            if not n.options.map_entry:
                message(n, (*path, 3, i), f"{name}.{n.name}")
        for i, e in enumerate(m.enum_type):
            enum(e, (*path, 4, i), f"{name}.{e.name}")
        for i, o in enumerate(m.oneof_decl):
            need((*path, 8, i), f"oneof {name}.{o.name}")

    for i, m in enumerate(fd.message_type):  # FileDescriptorProto: message_type=4, enum_type=5, service=6
        message(m, (4, i), m.name)
    for i, e in enumerate(fd.enum_type):
        enum(e, (5, i), e.name)
    for i, s in enumerate(fd.service):
        need((6, i), f"service {s.name}")
        for j, rpc in enumerate(s.method):
            need((6, i, 2, j), f"rpc {s.name}.{rpc.name}")
    return missing


@pytest.mark.parametrize("our_file", sorted(OUR_FILES))
def test_every_element_is_commented(our_file, ours_from_source):
    assert _uncommented(ours_from_source[our_file]) == []


@pytest.mark.parametrize("our_file", sorted(OUR_FILES))
def test_generated_stubs_match_the_sources(our_file, ours_from_source):
    """The importable inference.*_pb2 (Bazel's or gen_protos.py's) was generated from these sources."""
    try:
        raw = _serialized_descriptor(OUR_MODULES[our_file], pythonpath=sys.path)
    except ImportError as exc:
        pytest.fail(f"{exc}\n(generate stubs: `python libs/kvmesh/gen_protos.py` or `bazel build //protos:all`)")
    generated = descriptor_pb2.FileDescriptorProto.FromString(raw)
    source = descriptor_pb2.FileDescriptorProto()
    source.CopyFrom(ours_from_source[our_file])
    source.ClearField("source_code_info")
    for fd in (generated, source):  # json_name is filled in by some protoc paths and not others
        for msg in _messages(fd).values():
            for field in msg.field:
                field.ClearField("json_name")
    assert generated == source, f"{OUR_MODULES[our_file]} is stale: regenerate the stubs"
