"""How fast the fallback's userspace delay wire moves packets (``python -m tests.multihost.wire_speed``).

Two namespaces on a bridge (the link tests' pair); for the clear link and the link with a 1 ms wire:
64-byte UDP datagrams flooded for 3 s (packets/s sent and received) and bulk TCP goodput. Prints a
table; a measurement to read, not a test (the machine's load decides the figures).
"""

from __future__ import annotations

from kvmesh_bench import link_conditions as lc

from tests.multihost.test_link_conditions import pair


def main() -> None:
    fixture = pair.__wrapped__()  # type: ignore[attr-defined]  # the fixture's generator, outside pytest
    p = next(fixture)
    try:
        print("| link | UDP sent pkt/s | UDP received pkt/s | TCP goodput Mbit/s | TCP RTT p50 ms |")
        print("|---|---|---|---|---|")
        for label, delay in (("clear", 0.0), ("wire, 1 ms", 1.0)):
            lc.clear_all()
            if delay:
                lc.apply(p.a, delay_ms=delay)
            rate, flood = p.probe(
                p.b.netns, ["udp-rate", "7004", "3"], p.a.netns, ["udp-flood", "10.77.0.2", "7004", "3"]
            )
            goodput = p.goodput_mbit(p.a, "10.77.0.2", p.b, 2.0)
            print(
                f"| {label} | {flood['pps']:.0f} | {rate['pps']:.0f} | {goodput:.0f} | {p.rtt_ms(100):.2f} |",
                flush=True,
            )
    finally:
        lc.clear_all()
        next(fixture, None)


if __name__ == "__main__":
    main()
