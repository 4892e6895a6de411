"""py_grpc_library: Python protobuf + gRPC stubs from .proto files, offline.

Runs `python3 -m grpc_tools.protoc` (python3 = the first one on PATH, i.e. the project venv; see
/.bazelrc) in a genrule, with the calling package directory as the only import root, so
`protos/kvmesh/v1/x.proto` becomes module `kvmesh.v1.x_pb2` (exactly like
libs/kvmesh/gen_protos.py). grpc_tools.protoc adds the google/protobuf well-known types itself.
"""

def _dirs_of(paths):
    """Every directory (and parent directory) that holds one of `paths`, package-relative."""
    dirs = {}
    for p in paths:
        parts = p.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs["/".join(parts[:i])] = True
    return sorted(dirs.keys())

def py_grpc_library(name, srcs, namespace_dirs = [], deps = [], **kwargs):
    """Generates <x>_pb2.py and <x>_pb2_grpc.py for every proto in `srcs`.

    Args:
      name: the py_library holding the generated modules (its import root is this package).
      srcs: .proto files of this package (may be in subdirectories without a BUILD file).
      namespace_dirs: generated directories that get NO __init__.py, because a hand-written
        package of the same name lives elsewhere and extends its __path__ to this one (kvmesh).
        Every other generated directory gets an empty __init__.py, as gen_protos.py does, so
        these stubs win over stale ones another sys.path entry might hold.
      deps: py_library deps of the generated code.
      **kwargs: passed to the py_library (visibility, tags, ...).
    """
    outs = []
    for s in srcs:
        if not s.endswith(".proto"):
            fail("py_grpc_library: %s is not a .proto file" % s)
        stem = s[:-len(".proto")]
        outs += [stem + "_pb2.py", stem + "_pb2_grpc.py"]
    inits = [d + "/__init__.py" for d in _dirs_of(srcs) if d not in namespace_dirs]

    pkg = native.package_name()
    touch = " ".join(["$(RULEDIR)/" + i for i in inits])
    native.genrule(
        name = name + "_gen",
        srcs = srcs,
        outs = outs + inits,
        cmd = ("python3 -m grpc_tools.protoc -I%s --python_out=$(RULEDIR) --grpc_python_out=$(RULEDIR) $(SRCS)" % (pkg or ".")) +
              ((" && touch " + touch) if touch else ""),
        message = "protoc (grpc_tools) %d proto file(s) in //%s" % (len(srcs), pkg),
    )
    native.py_library(
        name = name,
        srcs = outs + inits,
        imports = ["."],
        srcs_version = "PY3",
        deps = deps,
        **kwargs
    )
