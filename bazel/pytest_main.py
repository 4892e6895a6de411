"""Entry point of every pytest_test (bazel/pytest.bzl): runs pytest inside the test's runfiles.

Before pytest starts it removes from sys.path every entry that points into the source tree
rather than into runfiles (the dev venv's kvmesh-dev.pth adds libs/*/src and services/*/src):
a Bazel test must see only what its BUILD deps declare, and the stubs Bazel generated, not the
ones gen_protos.py left in libs/kvmesh/src.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _hermetic_sys_path() -> None:
    runfiles = os.environ.get("RUNFILES_DIR") or os.environ.get("TEST_SRCDIR") or ""
    runfiles = os.path.realpath(runfiles) if runfiles else ""
    # This file is a runfiles symlink to <source tree>/bazel/pytest_main.py.
    source_root = Path(__file__).resolve().parent.parent
    allowed = [runfiles] if runfiles else []
    # The interpreter's own tree stays, even when the venv lives inside the checkout (.venv/).
    allowed += {os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix)}

    def under(path: str, root: str) -> bool:
        return path == root or path.startswith(root.rstrip(os.sep) + os.sep)

    kept = []
    for entry in sys.path:
        real = os.path.realpath(entry) if entry else entry
        if real and under(real, str(source_root)) and not any(under(real, a) for a in allowed):
            continue  # e.g. <checkout>/libs/kvmesh/src from the venv's kvmesh-dev.pth
        kept.append(entry)
    sys.path[:] = kept


def main() -> int:
    _hermetic_sys_path()
    import pytest  # imported only after the sys.path clean-up, on purpose

    args = ["-p", "no:cacheprovider", *sys.argv[1:]]
    if xml := os.environ.get("XML_OUTPUT_FILE"):
        args.append(f"--junitxml={xml}")
    if tmp := os.environ.get("TEST_TMPDIR"):
        args.append(f"--basetemp={os.path.join(tmp, 'pytest')}")
    rc = int(pytest.main(args))
    if rc == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("pytest_main: every test of this file was deselected by its markers; nothing to run")
        return 0
    return rc


if __name__ == "__main__":
    sys.exit(main())
