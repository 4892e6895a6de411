"""Issue 14 item 8, as a spec: with default flags an overloaded mesh rejects instead of queueing.

Real daemons, default limits, engines with ``--max-num-seqs 8``: a burst far beyond capacity gets
RESOURCE_EXHAUSTED for what does not fit (each engine queues at most 2 x max_num_seqs, the default),
the requests admitted start in bounded time, and nothing leaks.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.etcd, pytest.mark.e2e]


def test_a_burst_beyond_capacity_is_shed_not_queued(chaos):
    report = chaos("overload", burst=300, concurrency=150, speedup=1.0, tokens=48)
    assert set(report.failures) == {"RESOURCE_EXHAUSTED"}, report.table()
    assert report.ok >= 2 * 2 * 8, report.table()  # at least one full batch per engine served
    assert report.failures["RESOURCE_EXHAUSTED"] >= 100, report.table()
    assert (report.leaked_blocks, report.leaked_bookings) == (0, 0), report.table()
