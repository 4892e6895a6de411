"""Architecture rules ("daemons never import each other", no discovery import cycle) are a test, not a convention.

The import-linter contracts live in the root pyproject.toml ([tool.importlinter]).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_import_linter_contracts_hold():
    exe = Path(sys.executable).parent / "lint-imports"
    if not exe.exists() and shutil.which("lint-imports") is None:
        pytest.skip("import-linter is not installed in this environment")
    result = subprocess.run(
        [str(exe) if exe.exists() else "lint-imports", "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " kept, 0 broken." in result.stdout
