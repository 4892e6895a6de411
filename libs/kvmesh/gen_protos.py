"""Generate Python + gRPC stubs (and mypy .pyi) for every contract in protos/ into src/.

Stubs are build outputs: never edited, never committed (.gitignore). `make setup` and the
package build both call this, so a fresh clone always has stubs that match protos/.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
PROTOS = HERE.parent.parent / "protos"
OUT = HERE / "src"


def main() -> int:
    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    if not files:
        print(f"gen_protos: no .proto files under {PROTOS}", file=sys.stderr)
        return 2
    bindir = str(Path(sys.executable).parent)
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={OUT}",
        f"--grpc_python_out={OUT}",
    ]
    for plugin, flag in (("protoc-gen-mypy", "--mypy_out"), ("protoc-gen-mypy_grpc", "--mypy_grpc_out")):
        exe = shutil.which(plugin, path=bindir)
        if exe:  # typing stubs are a convenience: generate them where mypy-protobuf is installed
            args += [f"--plugin={plugin}={exe}", f"{flag}=quiet:{OUT}"]  # quiet: no "Writing mypy to" per file
    rc = protoc.main(args + files)
    if rc != 0:
        print(f"gen_protos: protoc failed with exit code {rc}", file=sys.stderr)
        return rc
    for pkg_dir in {(OUT / f).parent for f in files}:
        d = pkg_dir
        while d != OUT:  # generated folders become regular packages
            (d / "__init__.py").touch(exist_ok=True)
            d = d.parent
    return 0


if __name__ == "__main__":
    sys.exit(main())
