"""Discovery URLs, parsed without I/O: the backends open what these accept, and settings check with them.

Outside the ``kvmesh.discovery`` package on purpose: importing that package costs ~0.2 s, and every
command's settings (``kvmesh --help`` included) import this module.

One parser per scheme, so that a URL the settings take is one the backend can open: a looser check in
the settings once let ``etcd://host:99999`` or ``file:///d?poll=abc`` through, to a traceback at start-up.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

__all__ = ["DEFAULT_POLL_INTERVAL", "check_discovery_url", "parse_etcd_endpoints", "parse_file_url"]

#: File backend: how often a watcher re-reads the directory when no change notification came.
DEFAULT_POLL_INTERVAL = 0.1
_FORMS = "etcd://host:port[,host:port] or file:///abs/dir"


def parse_etcd_endpoints(url: str) -> list[tuple[str, int]]:
    """``etcd://h1:p1,h2:p2`` -> [(h1, p1), (h2, p2)]; port defaults to 2379; IPv6 as ``[::1]:2379``."""
    rest = url.removeprefix("etcd://")
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    if rest[len(netloc) :].strip("/"):  # a path or a query: nothing reads them, so a typo there would pass
        raise ValueError(f"discovery URL {url!r}: etcd URLs take no path or parameters, only host:port[,host:port]")
    if not netloc:
        raise ValueError(f"discovery URL {url!r}: etcd:// needs host:port[,host:port]")
    endpoints: list[tuple[str, int]] = []
    for item in netloc.split(","):
        item = item.strip()
        if item.startswith("["):
            host, _, tail = item[1:].partition("]")
            port_text = tail.removeprefix(":")
        elif item.count(":") == 1:
            host, _, port_text = item.partition(":")
        else:
            host, port_text = item, ""
        if not host:
            raise ValueError(f"discovery URL {url!r}: empty etcd host in {item!r}")
        try:
            port = int(port_text) if port_text else 2379
        except ValueError:
            raise ValueError(f"discovery URL {url!r}: bad etcd port in {item!r}") from None
        if not 0 < port < 65536:
            raise ValueError(f"discovery URL {url!r}: etcd port out of range in {item!r}")
        endpoints.append((host, port))
    return endpoints


def parse_file_url(url: str) -> tuple[Path | None, float]:
    """``file:///dir[?poll=S]`` -> (the directory, or None for the default one; the poll interval)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"discovery URL {url!r}: file URLs need an absolute path, e.g. file:///var/lib/kvmesh")
    if not parts.path:
        root = None
    else:
        root = Path(parts.path)
        if not root.is_absolute():
            raise ValueError(f"discovery URL {url!r}: file URLs need an absolute path, e.g. file:///var/lib/kvmesh")
    poll = DEFAULT_POLL_INTERVAL
    query = parse_qs(parts.query, keep_blank_values=True)
    if unknown := sorted(set(query) - {"poll"}):  # a typo (?pol=1) silently ran with the default
        raise ValueError(f"discovery URL {url!r}: unknown parameter {unknown[0]!r} (file URLs take only ?poll=S)")
    if "poll" in query:
        try:
            poll = float(query["poll"][-1])
        except ValueError:
            raise ValueError(f"discovery URL {url!r}: poll must be seconds, e.g. ?poll=0.1") from None
        if not 0 < poll <= 10:
            raise ValueError(f"discovery URL {url!r}: poll must be in (0, 10] seconds")
    return root, poll


def check_discovery_url(url: str) -> str:
    """``url`` if a backend can open it, else ValueError saying what is wrong (no I/O)."""
    if "\0" in url:
        raise ValueError(f"discovery URL {url!r}: contains a NUL character")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "etcd":
        parse_etcd_endpoints(url)
    elif scheme == "file":
        parse_file_url(url)
    else:
        raise ValueError(f"discovery URL {url!r}: expected {_FORMS}")
    return url
