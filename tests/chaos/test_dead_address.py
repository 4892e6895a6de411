"""Issue 14 item 6, the router's half: a refused KV-event stream excludes every engine at that address,
and a worker's NOT_FOUND for an engine's stream excludes that engine.

Real daemons, a 30 s lease TTL so that discovery cannot be what excludes them: two workers with 4
engines each and a router; one worker is killed with SIGKILL. Within a second or so (bounded here
generously for a loaded machine, far below the TTL) the router routes only to the surviving worker's
engines, while the dead worker's records are still in discovery.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
from kvmesh.v1 import router_pb2

from tests.router.test_router_e2e_harness import Mesh, Worker, prompt, seq_hashes, wait_until
from tests.support.daemons import Daemon

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
        warning = next(line for line in router.daemon.log_text().splitlines() if "is unreachable" in line)
        assert f":{dead.daemon.port} is unreachable (UNAVAILABLE: " in warning  # gRPC's reason, e.g. refused
        session.close()
    finally:
        mesh.close()


def test_a_killed_workers_engines_leave_the_fleet_without_it_being_called_reachable(tmp_path):
    """Once the killed worker's lease expires (2 s here) its engines leave the fleet, and the router forgets
    its verdict on them: silently, not with "worker ... is reachable again", the opposite of the truth."""
    mesh = Mesh(tmp_path)
    try:
        dead = mesh.worker(engines=2)
        router = mesh.router()
        wait_until(lambda: router.metrics().get("kvmesh_router_engines") == 2, 10, "both engines known")
        dead.daemon.signal(signal.SIGKILL)
        log = router.daemon.log_text
        wait_until(lambda: f":{dead.daemon.port} is unreachable" in log(), 10, "the dead worker noticed")
        wait_until(lambda: log().count("left the fleet") == 2, 15, "its engines gone with its lease")
        time.sleep(0.5)
        assert "is reachable again" not in log(), log()[-3000:]
        assert router.metrics().get("kvmesh_router_engines") == 0
    finally:
        mesh.close()


def test_a_worker_restarted_on_its_address_leaves_its_old_engines_out_long_before_their_lease_expires(tmp_path):
    """What ``Restart=on-failure`` with a fixed port does: the new process answers on the old address, so
    the address is reachable again, but it hosts new engines. The old ones' records outlive them (TTL 30 s)
    and the index still holds their blocks; the worker's NOT_FOUND for their KV streams takes them out of
    routing, so a prompt they cached goes to a live engine, not to a ghost."""
    mesh = Mesh(tmp_path)
    try:
        crashed = mesh.worker(*TTL, engines=4)
        alive = mesh.worker(*TTL, engines=4)
        router = mesh.router(*TTL)
        cached = {e: prompt(*(chr(65 + 4 * i + k) for k in range(4))) for i, e in enumerate(crashed.engine_ids)}
        for engine_id, tokens in cached.items():
            crashed.generate(engine_id, tokens)
        wait_until(
            lambda: all(set(seq_hashes(t)) <= router.index().get(e, set()) for e, t in cached.items()),
            10,
            "the crashed worker's blocks in the router's index",
        )
        crashed.daemon.signal(signal.SIGKILL)
        crashed.daemon.wait(10)
        restarted = Worker(Daemon("kvmesh-worker", crashed.daemon.args, tmp_path, crashed.daemon.port).wait_serving())
        try:
            serving = {*alive.engine_ids, *restarted.engine_ids}
            assert not set(cached) & serving
            session = router.session()
            fresh = wait_until(  # the restarted worker is routed: its address answers again
                lambda: session.route(f"fresh{time.monotonic_ns()}", prompt("Z")).engine_id in restarted.engine_ids,
                15,
                "a decision for an engine of the restarted worker",
                interval=0.2,
            )
            assert fresh
            for n in range(40):
                tokens = list(cached.values())[n % len(cached)]
                decision = session.route(f"after{n}", tokens)
                session.lifecycle(f"after{n}", router_pb2.LIFECYCLE_STAGE_FINISHED)
                assert decision.engine_id in serving, f"decision {n} went to an engine of the crashed process"
            session.close()
        finally:
            restarted.close()
    finally:
        mesh.close()


def test_the_load_of_a_worker_restarted_on_its_address_is_watched_beside_its_ghost(tmp_path):
    """The router watches each worker's load for ``--busy-kv-usage``; a worker restarted on its address is
    asked for its ghost engine too, and refuses the whole watch (NOT_FOUND). The watch then asks for what
    the worker hosts, so the new engine's own KV usage still makes it busy, not 30 s (the TTL) later."""
    mesh = Mesh(tmp_path)
    try:
        crashed = mesh.worker(*TTL, engines=1, blocks=64, speedup=1.0)
        router = mesh.router(*TTL, "--busy-kv-usage", "0.1")
        crashed.daemon.signal(signal.SIGKILL)
        crashed.daemon.wait(10)
        restarted = Worker(Daemon("kvmesh-worker", crashed.daemon.args, tmp_path, crashed.daemon.port).wait_serving())
        session = router.session()
        (engine,) = restarted.engine_ids
        runner = threading.Thread(
            target=restarted.generate, args=(engine, prompt(*"ABCDEFGH")), kwargs={"max_tokens": 300}
        )
        try:
            wait_until(  # the new engine is routed (not busy: nothing runs on it yet)
                lambda: session.route(f"w{time.monotonic_ns()}", prompt("X")).engine_id == engine, 15, "routed"
            )
            runner.start()  # 8+ active blocks on it that the router never booked: only its own report shows them

            def rejected() -> bool:
                decision = session.route(f"r{time.monotonic_ns()}", prompt("X"))
                if decision.outcome == router_pb2.DECISION_OUTCOME_ROUTED:
                    session.lifecycle(decision.request_id, router_pb2.LIFECYCLE_STAGE_FINISHED)
                return decision.outcome == router_pb2.DECISION_OUTCOME_REJECTED

            wait_until(rejected, 8, "busy from the restarted engine's own KV usage")
        finally:
            if runner.is_alive():
                runner.join(60)
            session.close()
            restarted.close()
    finally:
        mesh.close()
