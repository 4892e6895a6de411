"""Daemon settings: one frozen pydantic model per daemon, from which flags, ``KVMESH_*`` and TOML derive.

A daemon declares its settings once, as a subclass of :class:`DaemonSettings` (a field's docstring is
its help). Every field ``some_field`` (or its alias) is the flag ``--some-field``, the environment
variable ``KVMESH_SOME_FIELD`` and the TOML key ``some-field`` / ``some_field`` in ``[common]`` or
the daemon's table (``[worker]`` for ``kvmesh-worker``). Precedence, highest first: flag, environment,
config file (``--config`` / ``KVMESH_CONFIG``), default.

Rules (each a one-line error naming the setting and its source, exit 2):
- a value pydantic rejects, wherever it came from (no number is infinite or NaN), also one a higher
  source overrides (it would lie in wait for the day the flag goes);
- a TOML value of the wrong TOML type: ``true`` for a number (pydantic would read it as 1), anything
  but ``true``/``false`` for a switch, a number in quotes, a key given twice in one table
  (``log-level`` and ``log_level``), a file that is not UTF-8;
- an unknown flag, TOML table, TOML key, or ``KVMESH_*`` variable (``KVMESH_CONFIG`` and the
  ``KVMESH_TEST_*`` variables of the test tooling are not settings).
The environment is per process: a ``KVMESH_*`` variable for another daemon is an error here too.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from kvmesh.discovery_urls import check_discovery_url

EXIT_BAD_CONFIG = 2
#: sysexits' EX_UNAVAILABLE: something the daemon needs did not answer at start-up (discovery). Unlike a
#: bad setting, retrying can fix it: the systemd units restart on it and prevent restarts only on 2.
EXIT_UNAVAILABLE = 69
ENV_PREFIX = "KVMESH_"
_NOT_SETTINGS = ("KVMESH_CONFIG",)
_NOT_SETTINGS_PREFIX = "KVMESH_TEST_"
# Tables a shared config file may hold: [common] plus one per daemon (each daemon checks its own).
TABLES = ("common", "frontend", "router", "worker", "planner")


def fail(prog: str, message: str, code: int = EXIT_BAD_CONFIG) -> NoReturn:
    """The one way a daemon reports a problem the user must fix: one line, exit 2 (or ``code``)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(code)


def default_discovery_url() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvmesh-{os.getuid()}"
    return f"file://{Path(runtime) / 'kvmesh-discovery'}"


#: etcd's own bound on a lease TTL (larger grants fail at start-up, after the settings took them).
MAX_LEASE_TTL_S = 9_000_000_000
Port = Annotated[int, Field(ge=0, le=65535)]
Seconds = Annotated[float, Field(ge=0)]
NonEmpty = Annotated[str, Field(min_length=1)]
DiscoveryUrl = Annotated[str, AfterValidator(check_discovery_url)]


class DaemonSettings(BaseModel):
    """Settings every daemon has; a daemon subclasses it with its own fields (frozen, keyword-only)."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True, validate_by_name=True, allow_inf_nan=False
    )

    discovery: DiscoveryUrl = Field(default_factory=default_discovery_url)
    """discovery backend: etcd://host:port[,host:port] or file:///dir (one machine, no server)"""
    namespace: NonEmpty = "kvmesh"
    """deployment namespace; daemons only see their own"""
    lease_ttl: Annotated[float, Field(ge=1, le=MAX_LEASE_TTL_S)] = 10.0
    """discovery lease TTL in seconds (1 or more: etcd counts in seconds); keepalive runs every TTL/3"""
    host: NonEmpty = "127.0.0.1"
    """address other daemons use to reach this one"""
    bind_host: NonEmpty = "127.0.0.1"
    """interface the gRPC server and /metrics listen on (0.0.0.0 = every interface; say so explicitly)"""
    tls_cert: str = ""
    """PEM certificate of this daemon (mesh CA, SAN spiffe://kvmesh/<role>/<name>); with --tls-key and --tls-ca: mTLS"""
    tls_key: str = ""
    """PEM private key for --tls-cert"""
    tls_ca: str = ""
    """PEM mesh CA: peers (servers and clients alike) must present a certificate it issued"""
    etcd_tls: bool = False
    """mTLS to etcd with --tls-cert/--tls-key, trusting --etcd-ca (default --tls-ca): etcd --client-cert-auth"""
    etcd_ca: str = ""
    """PEM CA of etcd's server certificate, when etcd has its own CA (with --etcd-tls)"""
    metrics_port: Annotated[int, Field(ge=-1, le=65535)] = -1
    """Prometheus /metrics port (0 = any free port, -1 = disabled)"""
    otel_exporter: Literal["none", "console", "otlp"] = "none"
    """OpenTelemetry trace exporter"""
    otel_endpoint: str = "http://127.0.0.1:4317"
    """OTLP gRPC endpoint for --otel-exporter otlp"""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """log level"""
    log_format: Literal["text", "json"] = "text"
    """log format"""
    drain_timeout: Seconds = 30.0
    """seconds in-flight calls may take to finish after SIGTERM"""

    @model_validator(mode="after")
    def _tls_all_or_none(self) -> Self:
        given = {"--tls-cert": self.tls_cert, "--tls-key": self.tls_key, "--tls-ca": self.tls_ca}
        if any(given.values()) and not all(given.values()):
            missing = ", ".join(flag for flag, value in given.items() if not value)
            raise ValueError(f"TLS needs --tls-cert, --tls-key and --tls-ca together; missing {missing}")
        if self.etcd_tls and not self.tls_cert:
            raise ValueError("--etcd-tls needs --tls-cert, --tls-key and --tls-ca (the certificate shown to etcd)")
        for flag, path in {**given, "--etcd-ca": self.etcd_ca}.items():
            if path and not os.access(path, os.R_OK):
                # The key's value is never echoed: given its PEM instead of its path, it went to the logs.
                shown = flag if flag == "--tls-key" else f"{flag} {path}"
                raise ValueError(f"{shown}: not a readable file (give the file's path)")
        if self.tls_cert:
            check_pem(self.tls_cert, self.tls_key, self.tls_ca, self.etcd_ca)
        return self

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert)

    @classmethod
    def load(
        cls, prog: str, description: str, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> Self:
        """Parse flags, environment and config file for daemon ``prog``; on any problem print one line, exit 2."""
        env = os.environ if environ is None else environ
        names = {_key(name, info): name for name, info in cls.model_fields.items()}
        flags = vars(_parser(cls, prog, description).parse_args(argv))
        config_flag: str | None = flags.pop("config", None)
        config_path = config_flag if config_flag is not None else env.get(f"{ENV_PREFIX}CONFIG")
        try:
            if config_flag == "":
                raise _Problem("--config: empty path (leave the flag out for no config file)")
            raw: dict[str, tuple[Any, str]] = {}  # field -> (value, source), lowest precedence first
            shadowed: list[tuple[str, Any, str]] = []  # values a higher source overrides: still checked

            def put(name: str, value: Any, source: str) -> None:
                if name in raw:
                    shadowed.append((name, *raw[name]))
                raw[name] = (value, source)

            if config_path:
                for key, value in _load_toml(config_path, prog, cls).items():
                    put(names[key], value, config_path)
            for var, value in env.items():
                if not is_setting_variable(var):
                    continue
                key = var.removeprefix(ENV_PREFIX).lower()
                if key not in names:
                    raise _Problem(f"{var}: unknown setting (environment)")
                put(names[key], value, var)
            for key, value in flags.items():
                put(names[key], value, "flag")
            settings = cls._validated(raw, names)
            assert settings is not None  # (only None for a check of one field)
            # A bad value is an error wherever it is, even where a flag overrides it: else it lies in wait
            # in a unit's Environment= or the TOML file for the day the flag goes.
            for name, value, source in shadowed:
                cls._validated({**raw, name: (value, source)}, names, only=name)
            return settings
        except _Problem as exc:
            fail(prog, str(exc))

    @classmethod
    def _validated(
        cls, raw: Mapping[str, tuple[Any, str]], names: Mapping[str, str], only: str | None = None
    ) -> Self | None:
        """The settings of ``raw``; with ``only``, just the check of that field's own value (an overridden
        one: how it would combine with the others, a TLS certificate with another key, does not matter)."""
        try:
            return cls.model_validate({name: value for name, (value, _) in raw.items()})
        except ValidationError as exc:
            errors = exc.errors()
            if only is not None:
                errors = [e for e in errors if e["loc"] and names.get(str(e["loc"][0]), str(e["loc"][0])) == only]
                if not errors:
                    return None
            error = errors[0]
            loc = str(error["loc"][0]) if error["loc"] else ""
            name = names.get(loc, loc)  # pydantic may report a field by its alias
            if name not in cls.model_fields:
                raise _Problem(error["msg"].removeprefix("Value error, ")) from None
            source = raw[name][1] if name in raw else "default"
            flag = "--" + _key(name, cls.model_fields[name]).replace("_", "-")
            raise _Problem(f"{flag} (from {source}): {error['msg'].removeprefix('Value error, ')}") from None

    @classmethod
    def variables(cls) -> frozenset[str]:
        """The ``KVMESH_*`` environment variables this daemon reads."""
        return frozenset(ENV_PREFIX + _key(name, info).upper() for name, info in cls.model_fields.items())


def check_pem(cert: str, key: str, ca: str, etcd_ca: str = "") -> None:
    """The PEM files load (gRPC would only say it cannot bind the port); ssl checks the key matches the cert."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert, key, password=b"")  # an encrypted key fails here, as it would in gRPC
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate and its key ({exc})") from None
    for flag, path in (("--tls-ca", ca), ("--etcd-ca", etcd_ca)):
        if path:
            try:
                context.load_verify_locations(path)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"{flag} {path}: not a PEM CA certificate ({exc})") from None


def is_setting_variable(var: str) -> bool:
    """Whether ``var`` is meant for a daemon's settings (so unknown ones are errors, not ignored)."""
    return var.startswith(ENV_PREFIX) and var not in _NOT_SETTINGS and not var.startswith(_NOT_SETTINGS_PREFIX)


class _Problem(Exception):
    """A configuration problem the user can fix; the message names the setting and its source."""


def _key(name: str, info: FieldInfo) -> str:
    """The setting's external name (flag/env/TOML key, underscores) — its alias where it has one."""
    return info.alias or name


def _parser(cls: type[DaemonSettings], prog: str, description: str) -> argparse.ArgumentParser:
    table = prog.removeprefix("kvmesh-")
    parser = _OneLineParser(prog=prog, description=description, argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE", help=f"TOML file: tables [common], [{table}] (env KVMESH_CONFIG)")
    for name, info in cls.model_fields.items():
        key = _key(name, info)
        default = info.get_default(call_default_factory=True)
        help_text = f"{info.description} (env {ENV_PREFIX}{key.upper()}; default: {default!r})"
        flag = "--" + key.replace("_", "-")
        if info.annotation is bool:
            parser.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            choices = _choices(info.annotation)
            parser.add_argument(flag, dest=key, choices=choices, metavar=_metavar(info), help=help_text)
    return parser


def _choices(annotation: Any) -> tuple[str, ...] | None:
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else None


def _metavar(info: FieldInfo) -> str | None:
    if _choices(info.annotation):
        return None
    inner = [a for a in typing.get_args(info.annotation) if a is not types.NoneType] or [info.annotation]
    return {int: "N", float: "X"}.get(inner[0], "TEXT")


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)


def _load_toml(path: str, prog: str, cls: type[DaemonSettings]) -> dict[str, Any]:
    """``[common]`` merged with the daemon's table, keys normalized to underscores; unknown → error."""
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise _Problem(f"--config: cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise _Problem(f"--config: {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise _Problem(f"--config: {path} is not valid TOML: not UTF-8 text") from None
    for table, entries in doc.items():
        if table not in TABLES:
            raise _Problem(f"--config: unknown table [{table}] in {path} (expected {', '.join(TABLES)})")
        if not isinstance(entries, dict):
            raise _Problem(f"--config: [{table}] in {path} must be a table")
    common = {_key(name, info) for name, info in DaemonSettings.model_fields.items()}
    fields = {_key(name, info): info for name, info in cls.model_fields.items()}
    merged: dict[str, Any] = {}
    for table, allowed in (("common", common), (prog.removeprefix("kvmesh-"), set(fields))):
        seen: dict[str, str] = {}
        for key, value in doc.get(table, {}).items():
            normalized = key.replace("-", "_")
            if normalized not in allowed:
                raise _Problem(f"--config: unknown setting {key!r} in [{table}] of {path}")
            if normalized in seen:
                raise _Problem(
                    f"--config: {seen[normalized]!r} and {key!r} are one setting, twice in [{table}] of {path}"
                )
            seen[normalized] = key
            info = fields[normalized]
            if isinstance(value, bool) and not _takes_bool(info):
                raise _Problem(f"--config: {key} in [{table}] of {path}: {str(value).lower()} is not a {_kind(info)}")
            if _takes_bool(info) and not isinstance(value, bool):
                raise _Problem(f"--config: {key} in [{table}] of {path}: write true or false, not {value!r}")
            if isinstance(value, str) and _kind(info) == "number" and _is_number(value):
                raise _Problem(f"--config: {key} in [{table}] of {path}: write the number {value} without quotes")
            merged[normalized] = value
    return merged


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _takes_bool(info: FieldInfo) -> bool:
    return info.annotation is bool or bool in typing.get_args(info.annotation)


def _kind(info: FieldInfo) -> str:
    """What the setting takes, in words, for an error message."""
    metavar = _metavar(info)
    return {"N": "number", "X": "number"}.get(metavar or "", "string")
