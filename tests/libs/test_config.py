"""Settings come from flags, KVMESH_* variables and a TOML file, in that order of precedence."""

import pytest
from kvmesh.config import Flag, parse_config, positive_int

FLAGS = [
    Flag("num-engines", "engines per process", default=1, type=positive_int),
    Flag("speedup-ratio", "simulation speed", default=1.0, type=float),
    Flag("enable-thing", "a switch", default=False, is_bool=True),
]


def parse(argv, env=None):
    return parse_config("kvmesh-worker", "test", FLAGS, argv, environ=env or {})


def test_defaults_apply_when_nothing_is_set():
    cfg = parse([])
    assert (cfg.num_engines, cfg.speedup_ratio, cfg.enable_thing) == (1, 1.0, False)
    assert cfg.namespace == "kvmesh" and cfg.discovery.startswith("file:///")
    assert cfg.sources["num_engines"] == "default"


def test_flag_beats_env_beats_file(tmp_path):
    conf = tmp_path / "kvmesh.toml"
    conf.write_text('[common]\nnamespace = "from-file"\n[worker]\nnum_engines = 3\nspeedup-ratio = 2.5\n')
    env = {"KVMESH_NUM_ENGINES": "5", "KVMESH_ENABLE_THING": "yes"}
    cfg = parse(["--config", str(conf), "--speedup-ratio", "9"], env)
    assert cfg.speedup_ratio == 9.0 and cfg.sources["speedup_ratio"] == "flag"
    assert cfg.num_engines == 5 and cfg.sources["num_engines"] == "env"
    assert cfg.namespace == "from-file" and cfg.sources["namespace"] == "file"
    assert cfg.enable_thing is True


def test_config_file_from_env(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text("[worker]\nnum-engines = 4\n")
    assert parse([], {"KVMESH_CONFIG": str(conf)}).num_engines == 4


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--num-engines", "0"], {}, "argument --num-engines: must be >= 1, got 0"),
        ([], {"KVMESH_NUM_ENGINES": "many"}, "--num-engines (from KVMESH_NUM_ENGINES)"),
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        (["--discovery", "redis://x"], {}, "expected etcd://host:port"),
        (["--discovery", "etcd://nohost"], {}, "is not host:port"),
        ([], {"KVMESH_ENABLE_THING": "maybe"}, "--enable-thing (from KVMESH_ENABLE_THING): expected true/false"),
        (["--log-level", "loud"], {}, "invalid choice: 'loud'"),
    ],
)
def test_bad_config_exits_2_with_one_line_naming_the_flag(argv, env, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(argv, env)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvmesh-worker: error: ")
    assert needle in err


def test_bad_config_file_is_reported(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[worker\n")
    with pytest.raises(SystemExit):
        parse(["--config", str(bad)])
    assert "is not valid TOML" in capsys.readouterr().err
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[worker]\nnum-engine = 2\n")
    with pytest.raises(SystemExit):
        parse(["--config", str(unknown)])
    assert "unknown setting 'num-engine'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--config", str(tmp_path / "missing.toml")])
    assert "cannot read" in capsys.readouterr().err
