"""Issue 14 item 6, the router's half: a refused KV-event stream excludes every engine at that address.

Real daemons, a 30 s lease TTL so that discovery cannot be what excludes them: two workers with 4
engines each and a router; one worker is killed with SIGKILL. Within a second or so (bounded here
generously for a loaded machine, far below the TTL) the router routes only to the surviving worker's
engines, while the dead worker's records are still in discovery.
"""

from __future__ import annotations

import signal
import time

import pytest
from kvmesh.v1 import router_pb2

from tests.router.test_router_e2e_harness import Mesh, prompt

pytestmark = pytest.mark.e2e

TTL = ["--lease-ttl", "30"]


def test_router_stops_routing_to_a_killed_worker_long_before_its_lease_expires(tmp_path):
    mesh = Mesh(tmp_path)
    try:
        dead = mesh.worker(*TTL, engines=4)
        alive = mesh.worker(*TTL, engines=4)
        router = mesh.router(*TTL)
        session = router.session()
        seen: set[int] = set()
        for i in range(200):  # both workers are routable
            decision = session.route(f"warm{i}", prompt(chr(65 + i % 26), chr(65 + (i * 7) % 26)))
            session.lifecycle(f"warm{i}", router_pb2.LIFECYCLE_STAGE_FINISHED)
            seen.add(decision.engine_id)
            if seen & set(dead.engine_ids) and seen & set(alive.engine_ids):
                break
        assert seen & set(dead.engine_ids) and seen & set(alive.engine_ids), seen

        dead.daemon.signal(signal.SIGKILL)
        killed = time.monotonic()
        clean = 0
        n = 0
        while clean < 40:  # 40 decisions in a row on the survivor (random picks would hit the dead one)
            assert time.monotonic() - killed < 10, "still routing to the dead worker"
            decision = session.route(f"after{n}", prompt(chr(65 + n % 26)))
            session.lifecycle(f"after{n}", router_pb2.LIFECYCLE_STAGE_FINISHED)
            clean = clean + 1 if decision.engine_id in alive.engine_ids else 0
            n += 1
        excluded_after = time.monotonic() - killed
        print(f"dead address excluded {excluded_after:.2f}s after kill -9")
        assert excluded_after < 5.0  # the TTL is 30 s: this can only be the refused KV-event stream
        assert "unreachable" in router.daemon.log_text()
        session.close()
    finally:
        mesh.close()
