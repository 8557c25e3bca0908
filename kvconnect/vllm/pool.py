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

    def probe_key(self, block_hash: str) -> str:
        """The one object of the block a lookup asks about (a load checks them all)."""
        return f"{self.prefix}{block_hash}/{self.layers - 1}.{self.chunks - 1}"


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
        self.keys: PoolKeys | None = None
        """Set once the workers described their KV cache; until then every lookup misses."""

    def leading(self, hashes: Sequence[str]) -> int:
        """Blocks from the first that the pool holds; 0 when the store cannot be asked (the
        client's breaker makes that fast while the store is down)."""
        keys = self.keys
        if keys is None:
            return 0
        try:
            found = self._client.batch_exists([keys.probe_key(h) for h in hashes])
        except StoreError as exc:
            log.debug("pool lookup failed, treating as a miss: %s", exc)
            return 0
        for count, present in enumerate(found):
            if not present:
                return count
        return len(found)
