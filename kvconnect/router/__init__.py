"""kvconnect's router: a cache-aware, load-aware, SLO-aware front for vLLM PD fleets.

The pure core (no sockets, threads or clock) is the block-hash chain (:mod:`.hashing`), the
global prefix index (:mod:`.index`), the cost model (:mod:`.cost`) and the routing policies
(:mod:`.policy`); the values they exchange live in :mod:`.types`. The HTTP front, the fleet's
health and the KV-event subscribers are built on top of them.
"""
