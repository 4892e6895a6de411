"""The worker's own settings rules, beyond the shared ones (tests/libs/test_settings.py)."""

from __future__ import annotations

import pytest
from kvmesh_worker.settings import Settings


@pytest.mark.parametrize("value", ["inf", "nan", "1e400"])
def test_a_non_finite_engine_bound_in_the_config_file_is_one_line(tmp_path, capsys, value):
    """The worker derives --max-waiting-requests from --max-num-seqs before validating: int(inf) raised
    OverflowError there, a traceback, instead of the field's own error."""
    path = tmp_path / "kvmesh.toml"
    path.write_text(f"[worker]\nmax-num-seqs = {value}\n")
    with pytest.raises(SystemExit) as exc:
        Settings.load("kvmesh-worker", "test", ["--config", str(path)], environ={})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvmesh-worker: error: --max-num-seqs (from {path}): "), err
