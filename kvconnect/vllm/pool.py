"""The shared prefix pool: store keys of vLLM blocks, and the scheduler side's lookup.

A block of one TP rank is ``layers x chunks`` store objects (each layer's K|V ranges are
separate memory), keyed by vLLM's block hash (chained over the prefix, so a key names the
whole prefix up to its block) plus what makes bytes interchangeable: model and the rank's KV
format (the compatibility hash: dtype, block size, layout, TP size).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvconnect.errors import StoreError
from kvconnect.store.client import StoreClient
from kvconnect.store.messages import MAX_BATCH

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolKeys:
    """Key scheme of one rank's blocks."""

    prefix: str
    layers: int
    chunks: int

    @property
    def per_block(self) -> int:
        return self.layers * self.chunks

    def block_keys(self, block_hash: str) -> list[str]:
        """The block's objects, layer by layer, chunk by chunk."""
        return [
            f"{self.prefix}{block_hash}/{layer}.{chunk}"
            for layer in range(self.layers)
            for chunk in range(self.chunks)
        ]

    def block_of(self, key: str) -> str | None:
        """The block hash a key of this scheme belongs to (the inverse of
        :meth:`block_keys`), or None for a key of another scheme."""
        if not key.startswith(self.prefix):
            return None
        block_hash, slash, _part = key[len(self.prefix) :].partition("/")
        return block_hash if slash and block_hash else None


def pool_keys(
    *, namespace: str, model: str, compat: str, tp_rank: int, layers: int, chunks: int
) -> PoolKeys:
    """The key scheme of TP rank ``tp_rank``'s blocks."""
    space = f"{namespace}/" if namespace else ""
    prefix = f"{space}vllm/{model.replace('/', '--')}/{compat[:16]}/tp{tp_rank}/"
    return PoolKeys(prefix, layers, chunks)


class StorePoolIndex:
    """Looks blocks up in the store (scheduler side, one master call per lookup)."""

    def __init__(self, client: StoreClient) -> None:
        self._client = client
        self.keys: tuple[PoolKeys, ...] = ()
        """Every TP rank's key scheme, set once the workers described their KV cache; until
        then every lookup misses."""

    def leading(self, hashes: Sequence[str]) -> int:
        """Blocks from the first that the pool holds whole: every object of the block, of
        every rank (a block missing one part would fail its load, and under vLLM's default
        ``kv_load_failure_policy=fail`` the request). 0 when the store cannot be asked (the
        client's breaker makes that fast while the store is down)."""
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
        for count in range(len(hashes)):
            if not all(found[count * per_block : (count + 1) * per_block]):
                return count
        return len(hashes)
