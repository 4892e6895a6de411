"""Makes ``tests.support`` (shared test helpers: real etcd, daemon subprocesses) importable, and gives the
tests' subprocesses a working Ctrl-C."""

import signal
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config: object) -> None:
    # A background job of a non-interactive shell (``make test &`` in a script) starts with SIGINT ignored,
    # and an ignored signal stays ignored across exec: every ``kvmesh up`` a test starts would then shrug
    # off the Ctrl-C (SIGINT) the tests stop it with, and hang until killed. A handled signal resets to its
    # default in an exec'd child, so handling it here gives the children what a terminal gives them.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
