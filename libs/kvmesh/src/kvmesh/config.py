"""Daemon configuration: command-line flags, ``KVMESH_*`` environment variables and a TOML file.

Precedence, highest first: flag, environment variable, config file, built-in default. Every
flag ``--some-flag`` has the environment variable ``KVMESH_SOME_FLAG`` and the TOML key
``some-flag`` (or ``some_flag``) in the daemon's table (``[worker]``, ``[router]``, ...) or in
``[common]``. Values from every source go through the same parser, so a bad value is reported
the same way wherever it came from: one line naming the flag, its source and the problem, then
exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

EXIT_BAD_CONFIG = 2
ENV_PREFIX = "KVMESH_"


class ConfigError(Exception):
    """A configuration problem the user can fix; the message names the flag."""


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"expected true/false, got {text!r}")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"must be a TCP port in 0..65535, got {value}")
    return value


@dataclass(frozen=True)
class Flag:
    """One setting; ``type`` parses a string (from any source) into the value."""

    name: str
    help: str
    default: Any = None
    type: Callable[[str], Any] = str
    choices: Sequence[str] | None = None
    is_bool: bool = False
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


def default_discovery_url() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvmesh-{os.getuid()}"
    return f"file://{Path(runtime) / 'kvmesh-discovery'}"


def discovery_url(text: str) -> str:
    if text.startswith("etcd://"):
        hosts = text.removeprefix("etcd://").strip("/")
        if not hosts:
            raise ValueError("etcd:// needs host:port[,host:port]")
        for host in hosts.split(","):
            name, _, port_text = host.rpartition(":")
            if not name or not port_text.isdigit():
                raise ValueError(f"etcd endpoint {host!r} is not host:port")
        return text
    if text.startswith("file://"):
        path = text.removeprefix("file://")
        if not path.startswith("/"):
            raise ValueError("file:// needs an absolute directory, e.g. file:///var/lib/kvmesh")
        return text
    raise ValueError(f"expected etcd://host:port[,host:port] or file:///dir, got {text!r}")


COMMON_FLAGS: tuple[Flag, ...] = (
    Flag(
        "discovery",
        "discovery backend: etcd://host:port[,host:port] or file:///dir (one machine, no server)",
        default=None,
        type=discovery_url,
        metavar="URL",
    ),
    Flag("namespace", "deployment namespace; daemons only see their own", default="kvmesh"),
    Flag(
        "lease-ttl",
        "discovery lease TTL in seconds; keepalive runs every TTL/3",
        default=10.0,
        type=non_negative_float,
        metavar="SECONDS",
    ),
    Flag("host", "address other daemons use to reach this one", default="127.0.0.1"),
    Flag("metrics-port", "Prometheus /metrics port (0 = any free port, -1 = disabled)", default=-1, type=int),
    Flag("otel-exporter", "OpenTelemetry trace exporter", default="none", choices=("none", "console", "otlp")),
    Flag("otel-endpoint", "OTLP gRPC endpoint for --otel-exporter otlp", default="http://127.0.0.1:4317"),
    Flag("log-level", "log level", default="info", choices=("debug", "info", "warning", "error")),
    Flag("log-format", "log format", default="text", choices=("text", "json")),
    Flag(
        "drain-timeout",
        "seconds in-flight calls may take to finish after SIGTERM",
        default=30.0,
        type=non_negative_float,
        metavar="SECONDS",
    ),
)


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage dump) with exit code 2."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_CONFIG)


@dataclass
class Config:
    """Parsed settings: attribute access by flag dest, plus where each value came from."""

    values: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


def build_parser(prog: str, description: str, flags: Sequence[Flag]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--config", metavar="FILE", help=f"TOML config file ([common] and [{prog}] tables; env {ENV_PREFIX}CONFIG)"
    )
    for flag in flags:
        help_text = f"{flag.help} (env {env_name(flag.name)}; default: {flag.default!r})"
        if flag.is_bool:
            parser.add_argument(f"--{flag.name}", action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(
                f"--{flag.name}", type=_checked(flag), choices=flag.choices, metavar=flag.metavar, help=help_text
            )
    return parser


def _checked(flag: Flag) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return flag.type(text)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(flag.type, "__name__", "value")
    return convert


def _convert(flag: Flag, raw: Any, source: str) -> Any:
    if flag.is_bool:
        if isinstance(raw, bool):
            return raw
        try:
            return parse_bool(str(raw))
        except ValueError as exc:
            raise ConfigError(f"--{flag.name} (from {source}): {exc}") from None
    text = str(raw)
    try:
        value = flag.type(text)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"--{flag.name} (from {source}): {exc}") from None
    if flag.choices is not None and value not in flag.choices:
        raise ConfigError(f"--{flag.name} (from {source}): {value!r} is not one of {', '.join(flag.choices)}")
    return value


def _load_toml(path: str, prog: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config: {path} is not valid TOML: {exc}") from None
    section = prog.removeprefix("kvmesh-")
    merged: dict[str, Any] = {}
    for table in ("common", section):
        entries = doc.get(table, {})
        if not isinstance(entries, dict):
            raise ConfigError(f"--config: [{table}] in {path} must be a table")
        merged.update({key.replace("_", "-"): value for key, value in entries.items()})
    return merged


def parse_config(
    prog: str,
    description: str,
    flags: Sequence[Flag],
    argv: Sequence[str] | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    """Parse settings for daemon ``prog``; on any problem print one line and exit 2."""
    all_flags = [*COMMON_FLAGS, *flags]
    parser = build_parser(prog, description, all_flags)
    args = vars(parser.parse_args(argv))
    env = os.environ if environ is None else environ
    try:
        config_path = args.pop("config", None) or env.get(f"{ENV_PREFIX}CONFIG")
        file_values = _load_toml(config_path, prog) if config_path else {}
        known = {flag.name for flag in all_flags}
        unknown = sorted(set(file_values) - known)
        if unknown:
            raise ConfigError(f"--config: unknown setting {unknown[0]!r} in {config_path}")
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for flag in all_flags:
            if flag.dest in args:
                values[flag.dest], sources[flag.dest] = args[flag.dest], "flag"
            elif env_name(flag.name) in env:
                values[flag.dest] = _convert(flag, env[env_name(flag.name)], env_name(flag.name))
                sources[flag.dest] = "env"
            elif flag.name in file_values:
                values[flag.dest] = _convert(flag, file_values[flag.name], str(config_path))
                sources[flag.dest] = "file"
            else:
                values[flag.dest], sources[flag.dest] = flag.default, "default"
        if values.get("discovery") is None:
            values["discovery"] = default_discovery_url()
    except ConfigError as exc:
        fail(prog, str(exc))
    return Config(values, sources)
