"""kvmesh router: KV-aware request routing.

The core is pure, synchronous and clock-free (``now`` is always passed in), so the same objects run in
the router daemon (asyncio, real clock) and in offline discrete-event simulations (virtual time):

- :mod:`kvmesh_router.indexer`: which engines hold which prefix blocks, from their KV events
  (``KvIndexer.apply`` / ``find_matches`` / ``dump``), with a bounded size and a documented eviction policy.
- :mod:`kvmesh_router.slot_tracker`: each engine's active blocks and outstanding prefill tokens, predicted
  from the request lifecycle (add -> prefill completed -> free), with lazy expiry of stale bookings.
- :mod:`kvmesh_router.cost`: the router's cost function (Dynamo's ``overlap_weight * prefill_blocks +
  decode_blocks`` as the default, pluggable policies), the policy config and the per-query override.
- :mod:`kvmesh_router.selection`: selectors per routing mode (kv, round_robin, random, power_of_two,
  direct) and temperature sampling.
- :mod:`kvmesh_router.policies`: the one registry of selectors and cost policies, by name.
- :mod:`kvmesh_router.candidates`: composable candidate filters (the query's engines, its worker role).
- :mod:`kvmesh_router.approx`: approximate mode, a predicted prefix index built from the router's own
  decisions for engines that publish no KV events.
- :mod:`kvmesh_router.admission`: ``Admission.decide(request, now)``, select + book in one serialized step,
  busy thresholds and rejection.
"""

from kvmesh.grpc_core import apply_defaults

apply_defaults()  # before anything imports grpc (see kvmesh.grpc_core)
