"""Routing decisions: the fleet, the prefix index, the cost model and a policy put together.

:class:`Router` turns a prompt's token ids into a :class:`~kvconnect.router.types.Request`,
offers the policy the healthy instances as candidates (with what the index says each holds of
the prompt), checks the SLOs, and keeps the index in step with the fleet (an instance that goes
out loses its entries). It does no I/O.

Threads: everything runs on the router's event loop except :meth:`Router.apply_events`, which
the KV-event subscribers call from their own threads; the index is guarded by one lock held
only for the index calls.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence

from kvconnect._throttle import Throttle
from kvconnect.router.config import PolicyName, RouterConfig
from kvconnect.router.cost import CostModel, Estimate
from kvconnect.router.hashing import chain
from kvconnect.router.index import POOL, PrefixIndex
from kvconnect.router.instances import Fleet, Instance
from kvconnect.router.policy import CacheAware, Policy, Random, RoundRobin, admit
from kvconnect.router.types import Candidate, Choice, Rejection, Request, Role, Slo
from kvconnect.store.kvevents import (
    LOCALITY_REMOTE,
    OWNERSHIP_KVCONNECT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

log = logging.getLogger(__name__)

STORE = POOL
"""The event-source name of the store master's events (they describe the shared pool)."""


def make_policy(config: RouterConfig, cost: CostModel) -> Policy:
    """The policy ``config.policy`` names."""
    if config.policy is PolicyName.CACHE:
        return CacheAware(cost, config.block_size)
    if config.policy is PolicyName.ROUND_ROBIN:
        return RoundRobin()
    return Random(config.seed)


class Router:
    """The decisions of one router; see the module docstring."""

    def __init__(self, config: RouterConfig, fleet: Fleet) -> None:
        self._config = config
        self._fleet = fleet
        self._lock = threading.Lock()  # guards the index (event threads write it)
        self.index = PrefixIndex(config.index_capacity)
        self.cost = CostModel(
            prefill_tps=config.prefill_tps,
            pool_tps=config.pool_tps,
            decode_tbt=config.decode_tbt,
            k_waiting=config.k_waiting,
            prefill_overhead=config.prefill_overhead,
        )
        self.policy = make_policy(config, self.cost)
        self._slo = Slo(ttft=config.ttft_slo, tbt=config.tbt_slo)
        self._adapters: set[str] = set()  # LoRA names seen in events (their blocks hash apart)
        self._mismatch = Throttle()
        fleet.listen(self.instance_changed)

    def request(self, tokens: Sequence[int], model: str) -> Request:
        """The request for a prompt of ``tokens`` (empty when they are unknown: routed by load
        alone) asking for ``model``."""
        with self._lock:
            extra = model.encode() if model in self._adapters else b""
        blocks = chain(tokens, self._config.block_size, extra)
        with self._lock:
            pool = self.index.pool_leading(blocks) if blocks else 0
        return Request(blocks=blocks, prompt_tokens=len(tokens), pool_blocks=pool)

    def first_hop(self, request: Request, exclude: Collection[str] = ()) -> Choice | None:
        """Where the prompt is computed: a prefill instance or a unified one (unified only
        while no decode instance is in); None when no candidate is left."""
        roles = [Role.PREFILL, Role.UNIFIED] if self._fleet.healthy(Role.DECODE) else []
        roles = roles or [Role.UNIFIED]
        candidates = self.candidates(request, roles, exclude)
        return self.policy.prefill(request, candidates) if candidates else None

    def decode(self, request: Request, exclude: Collection[str] = ()) -> Choice | None:
        """The decode instance for a PD request; None when none is in."""
        candidates = self.candidates(request, [Role.DECODE], exclude)
        return self.policy.decode(request, candidates) if candidates else None

    def retry(self, role: Role, request: Request, exclude: Collection[str]) -> Choice | None:
        """Another instance of ``role`` for a hop that did not start (None: none left)."""
        if role is Role.DECODE:
            return self.decode(request, exclude)
        candidates = self.candidates(request, [role], exclude)
        return self.policy.prefill(request, candidates) if candidates else None

    def candidates(
        self, request: Request, roles: Sequence[Role], exclude: Collection[str] = ()
    ) -> list[Candidate]:
        """The healthy instances of ``roles`` not in ``exclude``, as the policy sees them."""
        instances = [i for i in self._fleet.healthy(*roles) if i.url not in exclude]
        with self._lock:
            cached = [self.index.leading(i.url, request.blocks) for i in instances]
        return [_candidate(i, c) for i, c in zip(instances, cached, strict=True)]

    def admit(self, request: Request, first: Choice, decode: Choice | None) -> Rejection | None:
        """The SLO verdict before dispatch: None to go ahead. TBT is predicted at the decode
        instance (the unified one in one hop)."""
        if self._slo.ttft is None and self._slo.tbt is None:
            return None
        ttft = self.estimate(request, first).seconds
        tbt = self.cost.predict_tbt(_candidate(self._fleet.get((decode or first).instance), 0))
        return admit(ttft, tbt, self._slo)

    def estimate(self, request: Request, choice: Choice) -> Estimate:
        """The cost model's TTFT of ``request`` at the chosen instance now, whatever the policy
        (its ``compute_tokens`` are what the instance computes: the in-flight count)."""
        candidate = _candidate(self._fleet.get(choice.instance), choice.cached_blocks)
        return self.cost.estimate(candidate, request, self._config.block_size)

    def decode_load(self, choice: Choice) -> float:
        """The chosen decode (or unified) instance's load now."""
        return self.cost.decode_load(_candidate(self._fleet.get(choice.instance), 0))

    def prefilled(self, choice: Choice, estimate: Estimate, seconds: float) -> None:
        """A request estimated as ``estimate`` at dispatch had its first token ``seconds``
        later at the chosen instance: calibrates the cost model."""
        self.cost.observe_prefill(
            choice.instance, estimate.work_tokens, seconds, estimate.pool_tokens
        )

    def decoded(self, choice: Choice, load: float, seconds: float, tokens: int) -> None:
        """``tokens`` streamed in ``seconds`` after the first at the chosen instance, whose
        decode load was ``load`` at dispatch: calibrates its TBT."""
        if tokens > 1:
            self.cost.observe_decode(choice.instance, load + 1, seconds / (tokens - 1))

    def instance_changed(self, instance: Instance) -> None:
        """Fleet listener: an instance that went out loses its index entries (its cache may
        be gone; its events rebuild them after it returns)."""
        if not instance.healthy:
            with self._lock:
                self.index.drop(instance.url)

    def apply_events(self, source: str, batch: KVEventBatch) -> None:
        """KV events of ``source`` (an instance URL, or :data:`STORE`) into the index; called
        on the subscribers' threads. Events of KV-cache groups other than the first (sliding
        window layers of hybrids) and of another block size than the router's are skipped."""
        with self._lock:
            for event in batch.events:
                self._apply(source, event)

    def publisher_reset(self, source: str) -> None:
        """``source``'s publisher restarted (its sequence went back): its cache is new."""
        with self._lock:
            self.index.cleared(source)

    def _apply(self, source: str, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self.index.cleared(source)
            return
        if event.group_idx not in (None, 0):
            return
        pool = source == STORE or event.ownership == OWNERSHIP_KVCONNECT
        pool = pool or event.locality == LOCALITY_REMOTE
        if isinstance(event, BlockRemoved):
            self.index.removed(source, event.block_hashes, pool, medium=event.medium)
        elif isinstance(event, BlockStored):
            self._stored(source, event, pool)

    def _stored(self, source: str, event: BlockStored, pool: bool) -> None:
        if source == STORE and not event.token_ids:
            self.index.stored_hashes(event.block_hashes)
            return
        if event.block_size != self._config.block_size:
            if self._mismatch.ready():
                log.warning(
                    "KV events of %s have blocks of %d tokens, the router %d (--block-size): "
                    "skipped",
                    source,
                    event.block_size,
                    self._config.block_size,
                )
            return
        if event.lora_name:
            self._adapters.add(event.lora_name)
        self.index.stored(
            source,
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_name.encode() if event.lora_name else b"",
            pool,
            medium=event.medium,
        )

    def index_entries(self) -> int:
        """Entries of the index now (any thread)."""
        with self._lock:
            return self.index.stats().entries


def _candidate(instance: Instance, cached_blocks: int) -> Candidate:
    return Candidate(
        name=instance.url,
        role=instance.role,
        load=instance.load,
        inflight=instance.inflight,
        inflight_tokens=instance.inflight_tokens,
        cached_blocks=cached_blocks,
        ours_in_load=instance.ours_in_load,
    )
