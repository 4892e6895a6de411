"""Settings come from flags, KVMESH_* variables and a TOML file, in that order of precedence.

A daemon declares them once, as a frozen pydantic model; everything else is derived from it.
"""

import pydantic
import pytest
from kvmesh.settings import DaemonSettings, is_setting_variable
from pydantic import PositiveInt


class WorkerLike(DaemonSettings):
    num_engines: PositiveInt = 1
    """engines per process"""
    speedup_ratio: float = 1.0
    """simulation speed"""
    enable_thing: bool = False
    """a switch"""


def load(argv, env=None):
    return WorkerLike.load("kvmesh-worker", "test", argv, environ=env or {})


def fails(argv, env=None, capsys=None):
    """Run ``load``, assert it exits 2 with one line, return that line."""
    with pytest.raises(SystemExit) as exc:
        load(argv, env)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvmesh-worker: error: "), err
    return err


def test_defaults_apply_when_nothing_is_set():
    cfg = load([])
    assert (cfg.num_engines, cfg.speedup_ratio, cfg.enable_thing) == (1, 1.0, False)
    assert cfg.namespace == "kvmesh" and cfg.discovery.startswith("file:///")


def test_flag_beats_env_beats_file(tmp_path):
    conf = tmp_path / "kvmesh.toml"
    conf.write_text(
        '[common]\nnamespace = "from-file"\n[worker]\nnum_engines = 3\nspeedup-ratio = 2.5\n[router]\nseed = 1\n'
    )
    env = {"KVMESH_NUM_ENGINES": "5", "KVMESH_ENABLE_THING": "yes"}
    cfg = load(["--config", str(conf), "--speedup-ratio", "9"], env)
    assert cfg.speedup_ratio == 9.0  # flag over file
    assert cfg.num_engines == 5  # env over file
    assert cfg.namespace == "from-file"  # file over default ([common]; [router] is another daemon's)
    assert cfg.enable_thing is True


def test_config_file_from_env(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text("[worker]\nnum-engines = 4\n")
    assert load([], {"KVMESH_CONFIG": str(conf)}).num_engines == 4


def test_variables_that_are_not_settings_are_left_alone():
    assert load([], {"KVMESH_TEST_ETCD": "/usr/bin/etcd", "PATH": "/bin"}).num_engines == 1


def test_settings_are_frozen_and_keyword_only():
    cfg = load([])
    with pytest.raises(pydantic.ValidationError):
        cfg.num_engines = 2  # type: ignore[misc]  # the point of the test
    with pytest.raises(TypeError):
        WorkerLike(2)  # type: ignore[misc]  # the point of the test
    assert WorkerLike(num_engines=2).num_engines == 2


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--num-engines", "0"], {}, "--num-engines (from flag): Input should be greater than 0"),
        ([], {"KVMESH_NUM_ENGINES": "many"}, "--num-engines (from KVMESH_NUM_ENGINES): Input should be a valid int"),
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        (["--discovery", "redis://x"], {}, "expected etcd://host:port"),
        # the backends' own parsers: what the settings take, a backend opens (etcd://host alone is port 2379)
        (
            ["--discovery", "etcd://h:99999"],
            {},
            "--discovery (from flag): discovery URL 'etcd://h:99999': etcd port out",
        ),
        (["--discovery", "file:///d?poll=abc"], {}, "discovery URL 'file:///d?poll=abc': poll must be seconds"),
        # a parameter nothing reads: a typo ran with the default (?pol=1), or an etcd URL's query was dropped
        (["--discovery", "file:///d?pol=1"], {}, "file:///d?pol=1': unknown parameter 'pol' (file URLs take only"),
        (["--discovery", "etcd://h:2379?x=1"], {}, "etcd URLs take no path or parameters, only host:port"),
        ([], {"KVMESH_DISCOVERY": "file:///d\u0000"}, "--discovery (from KVMESH_DISCOVERY): discovery URL"),
        (["--lease-ttl", "1e10"], {}, "--lease-ttl (from flag): Input should be less than or equal to 9000000000"),
        ([], {"KVMESH_ENABLE_THING": "maybe"}, "--enable-thing (from KVMESH_ENABLE_THING): Input should be a valid"),
        (["--log-level", "loud"], {}, "invalid choice: 'loud'"),
        ([], {"KVMESH_LOG_LEVEL": "loud"}, "--log-level (from KVMESH_LOG_LEVEL): Input should be 'debug'"),
        ([], {"KVMESH_NUM_ENGINE": "2"}, "KVMESH_NUM_ENGINE: unknown setting (environment)"),
        (["--speedup-ratio", "inf"], {}, "--speedup-ratio (from flag): Input should be a finite number"),
        (["--drain-timeout", "nan"], {}, "--drain-timeout (from flag): Input should be a finite number"),
        (["--lease-ttl", "0"], {}, "--lease-ttl (from flag): Input should be greater than or equal to 1"),
        # A keepalive every 0.3 ms: 60 % of a core and the lease flapping (file), etcd rounding it up anyway.
        (["--lease-ttl", "0.001"], {}, "--lease-ttl (from flag): Input should be greater than or equal to 1"),
        (["--namespace", ""], {}, "--namespace (from flag): String should have at least 1 character"),
        (["--host", ""], {}, "--host (from flag): String should have at least 1 character"),
        (["--config", ""], {}, "--config: empty path"),
        # a bad value is refused where it is, even under a flag that overrides it
        (["--num-engines", "2"], {"KVMESH_NUM_ENGINES": "abc"}, "--num-engines (from KVMESH_NUM_ENGINES): "),
    ],
)
def test_bad_config_exits_2_with_one_line_naming_the_setting_and_source(argv, env, needle, capsys):
    assert needle in fails(argv, env, capsys)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[worker\n", "is not valid TOML"),
        ("[worker]\nnum-engine = 2\n", "unknown setting 'num-engine' in [worker]"),
        ("[common]\nnum-engines = 2\n", "unknown setting 'num-engines' in [common]"),  # a worker setting
        ("[kvmesh-worker]\nnum-engines = 2\n", "unknown table [kvmesh-worker]"),
        ("namespace = 'top-level'\n", "unknown table [namespace]"),
        ("[worker]\nnum-engines = 0\n", "--num-engines (from {path}): Input should be greater than 0"),
        # pydantic would read true as 1: TOML's types are kept
        ("[common]\nlease-ttl = true\n", "lease-ttl in [common] of {path}: true is not a number"),
        ("[common]\nnamespace = false\n", "namespace in [common] of {path}: false is not a string"),
        ("[worker]\nnum-engines = '3'\n", "num-engines in [worker] of {path}: write the number 3 without quotes"),
        ("[worker]\nenable-thing = 'no'\n", "enable-thing in [worker] of {path}: write true or false, not 'no'"),
        ("[worker]\nenable-thing = 0\n", "enable-thing in [worker] of {path}: write true or false, not 0"),
        ("[common]\nlog_level = 'info'\nlog-level = 'debug'\n", "'log_level' and 'log-level' are one setting"),
        (b"\xff\xfe[worker]\n", "is not valid TOML: not UTF-8 text"),
    ],
)
def test_bad_config_file_exits_2_with_one_line(tmp_path, text, needle, capsys):
    path = tmp_path / "kvmesh.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert needle.format(path=path) in fails(["--config", str(path)], capsys=capsys)


def test_a_bad_file_value_under_a_flag_is_still_refused(tmp_path, capsys):
    path = tmp_path / "kvmesh.toml"
    path.write_text("[common]\nlog-level = 'verbose'\n")
    assert f"--log-level (from {path}): " in fails(["--config", str(path), "--log-level", "info"], capsys=capsys)


def test_a_boolean_setting_takes_a_toml_boolean(tmp_path):
    path = tmp_path / "kvmesh.toml"
    path.write_text("[worker]\nenable-thing = true\n")
    assert load(["--config", str(path)]).enable_thing is True


def test_tls_files_that_are_not_a_certificate_and_its_key_are_refused_at_load(tmp_path, capsys):
    """gRPC itself would only fail to bind the port; the settings name the file."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    tls = ["--tls-cert", str(garbage), "--tls-key", str(garbage), "--tls-ca", str(garbage)]
    assert f"--tls-cert {garbage} / --tls-key {garbage}: not a PEM certificate and its key" in fails(tls, capsys=capsys)


def test_missing_config_file_is_reported(tmp_path, capsys):
    assert "cannot read" in fails(["--config", str(tmp_path / "missing.toml")], capsys=capsys)


def test_help_shows_every_setting_with_its_default_and_variable(capsys):
    with pytest.raises(SystemExit) as exc:
        load(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name, info in WorkerLike.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = info.get_default(call_default_factory=True)
        assert f"{info.description} (env KVMESH_{name.upper()}; default: {default!r})" in out, flag
    assert "tables [common], [worker]" in out


def test_a_daemon_names_the_variables_it_reads():
    assert {"KVMESH_NUM_ENGINES", "KVMESH_DISCOVERY"} <= WorkerLike.variables()
    assert not {"KVMESH_CONFIG", "KVMESH_TEST_ETCD"} & WorkerLike.variables()
    assert [is_setting_variable(v) for v in ("KVMESH_X", "KVMESH_CONFIG", "KVMESH_TEST_ETCD", "PATH")] == [
        True,
        False,
        False,
        False,
    ]
