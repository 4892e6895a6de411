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


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        # The model card and the load reports carry these as uint32: past it, a traceback once serving.
        (
            ["--max-num-seqs", "5000000000"],
            "--max-num-seqs (from flag): Input should be less than or equal to 4294967295",
        ),
        (["--num-gpu-blocks", "5000000000"], "--num-gpu-blocks (from flag): Input should be less than or equal to"),
        (["--max-model-len", "5000000000"], "--max-model-len (from flag): Input should be less than or equal to"),
        (["--max-waiting-requests", "5000000000"], "--max-waiting-requests (from flag): Input should be less than"),
        # A hold's expiry time overflowed its uint64 field inside the engine loop, which died silently.
        (["--kv-hold-timeout", "1e300"], "--kv-hold-timeout (from flag): Input should be less than or equal to 86400"),
        # under 1 s every hold is born expired (a pull needs 0.5 s of it left): every remote prefill failed
        (["--kv-hold-timeout", "0.4"], "--kv-hold-timeout (from flag): Input should be greater than or equal to 1"),
        # 10 million engines were built for minutes, the memory growing, SIGTERM unheard
        (["--num-engines", "10000000"], "--num-engines (from flag): Input should be less than or equal to 10000"),
    ],
)
def test_a_bound_the_contracts_cannot_carry_is_one_line(capsys, flags, says):
    with pytest.raises(SystemExit) as exc:
        Settings.load("kvmesh-worker", "test", flags, environ={})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
