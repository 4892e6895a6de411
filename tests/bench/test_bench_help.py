"""Every ``kvmesh bench NAME --help`` prints its usage and exits 0 (a ``%`` in a help text once made one crash)."""

from __future__ import annotations

import pytest
from kvmesh_bench.cli import BENCHMARKS
from kvmesh_cli.main import main


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_help_prints_usage(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    assert f"kvmesh bench {name}" in capsys.readouterr().out
