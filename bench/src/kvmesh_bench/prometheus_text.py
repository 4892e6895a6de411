"""Reading a daemon's ``/metrics`` page: the one scraper the benchmarks and the tests share.

Parsed with ``prometheus_client``'s own text parser, so a label value with a space, a brace or an escaped
quote reads the same as the exposition meant it (the hand-written line matchers this replaces did not).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = ["metric_total", "metrics_url", "samples"]


def metrics_url(port: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{port}/metrics"


def samples(url: str, timeout: float = 5.0) -> list[Sample]:
    """Every sample of the page (``name`` is the sample's: ``..._total``, ``..._bucket``); OSError if unreachable."""
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        text = reply.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def metric_total(url: str, name: str, labels: Mapping[str, str] | None = None, timeout: float = 5.0) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (0 when there are none).

    Raises OSError when the page cannot be read: a caller that counts a dead daemon as 0 says so.
    """
    wanted = dict(labels or {}).items()
    return sum(s.value for s in samples(url, timeout) if s.name == name and wanted <= s.labels.items())
