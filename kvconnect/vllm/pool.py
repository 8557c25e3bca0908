"""The shared prefix pool: store keys of vLLM blocks, and the scheduler side's lookup.

A block of one TP rank is ``layers x chunks`` store objects (each layer's K|V ranges are
separate memory), keyed by vLLM's block hash (chained over the prefix, so a key names the
whole prefix up to its block) plus what makes bytes interchangeable: model and the rank's KV
format (the compatibility hash: dtype, block size, layout, TP size). In hybrid models a layer's
objects exist only where its KV-cache group saved the block (a sliding window: near the end
of a prompt); a hit is what every group can use (:func:`~kvconnect.vllm.groups.usable_hit`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvconnect.errors import StoreError
from kvconnect.store.client import StoreClient
from kvconnect.store.messages import MAX_BATCH
from kvconnect.vllm.groups import Group, usable_hit

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolKeys:
    """Key scheme of one rank's blocks."""

    prefix: str
    layers: int
    chunks: int
    groups: tuple[int, ...] = ()
    """The KV-cache group of each layer (empty: all in group 0)."""

    @property
    def per_block(self) -> int:
        return self.layers * self.chunks

    def key(self, block_hash: str, layer: int, chunk: int) -> str:
        """The object of one layer's chunk of a block."""
        return f"{self.prefix}{block_hash}/{layer}.{chunk}"

    def block_keys(self, block_hash: str) -> list[str]:
        """The block's objects, layer by layer, chunk by chunk."""
        return [
            self.key(block_hash, layer, chunk)
            for layer in range(self.layers)
            for chunk in range(self.chunks)
        ]

    def group_of(self, layer: int) -> int:
        return self.groups[layer] if self.groups else 0


def pool_keys(
    *,
    namespace: str,
    model: str,
    compat: str,
    tp_rank: int,
    layers: int,
    chunks: int,
    groups: Sequence[int] = (),
) -> PoolKeys:
    """The key scheme of TP rank ``tp_rank``'s blocks (``groups``: each layer's KV-cache
    group)."""
    space = f"{namespace}/" if namespace else ""
    prefix = f"{space}vllm/{model.replace('/', '--')}/{compat[:16]}/tp{tp_rank}/"
    return PoolKeys(prefix, layers, chunks, tuple(groups))


class StorePoolIndex:
    """Looks blocks up in the store (scheduler side, one master call per lookup)."""

    def __init__(self, client: StoreClient, block_size: int) -> None:
        self._client = client
        self._block_size = block_size
        self.keys: tuple[PoolKeys, ...] = ()
        """Every TP rank's key scheme, set once the workers described their KV cache; until
        then every lookup misses."""

    def leading(self, hashes: Sequence[str], groups: Sequence[Group], first: int) -> int:
        """Blocks from the first (block ``first`` of the prompt) that the pool holds usably
        for every group (:func:`~kvconnect.vllm.groups.usable_hit`): a group's part of a block
        counts when every object of it, of every rank, is there (a block missing one part
        would fail its load, and under vLLM's default ``kv_load_failure_policy=fail`` the
        request). 0 when the store cannot be asked (the client's breaker makes that fast
        while the store is down)."""
        ranks = self.keys
        per_block = sum(rank.per_block for rank in ranks)
        # One master call, within its batch limit: blocks past it count as misses (the load
        # of the hit, one store batch too, then fits as well).
        hashes = hashes[: MAX_BATCH // per_block] if per_block else ()
        if not hashes:
            return 0
        names = [key for h in hashes for rank in ranks for key in rank.block_keys(h)]
        try:
            found = self._client.batch_exists(names)
        except StoreError as exc:
            log.debug("pool lookup failed, treating as a miss: %s", exc)
            return 0
        missing: set[tuple[int, int]] = set()  # (group, block) with an object missing
        i = 0
        for block in range(len(hashes)):
            for rank in ranks:
                for layer in range(rank.layers):
                    if not all(found[i : i + rank.chunks]):
                        missing.add((rank.group_of(layer), first + block))
                    i += rank.chunks
        return usable_hit(
            groups, first, len(hashes), lambda g, p: (g, p) not in missing, self._block_size
        )
