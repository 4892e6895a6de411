"""Every ``kvmesh bench NAME --help`` prints its usage and exits 0 (a ``%`` in a help text once made one crash),
and a bench command loads no more of kvmesh than it runs."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
from kvmesh_bench.cli import BENCHMARKS
from kvmesh_cli.main import main


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_help_prints_usage(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    assert f"kvmesh bench {name}" in capsys.readouterr().out


def test_a_bench_command_builds_its_own_parser_only() -> None:
    """A replay's CPU time is what it measures: ``kvmesh bench replay`` must not import ``kvmesh up``'s daemons
    (the frontend's tokenizer pipeline, the daemons' settings); help for all commands still lists them all."""
    probe = (
        "import sys\n"
        "from kvmesh_cli.main import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit:\n"
        "    pass\n"
        "names = ('kvmesh_cli.up', 'kvmesh_frontend.pipeline', 'jinja2', 'kvmesh_router.settings')\n"
        "print(' '.join(m for m in names if m in sys.modules))\n"
    )
    run = functools.partial(subprocess.run, capture_output=True, text=True, check=True, timeout=120)
    bench = run([sys.executable, "-c", probe, "bench", "replay", "--help"])
    assert "usage: kvmesh bench replay" in bench.stdout
    assert bench.stdout.splitlines()[-1] == ""  # none of them was imported
    everything = run([sys.executable, "-c", probe, "--help"])
    assert "{up,model,certs,status,drain,router,bench,datagen,profile,planner}" in everything.stdout
    assert everything.stdout.splitlines()[-1] == "kvmesh_cli.up kvmesh_frontend.pipeline jinja2 kvmesh_router.settings"
