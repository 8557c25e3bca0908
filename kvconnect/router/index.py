"""The global prefix index: which instance, and whether the shared pool, holds which blocks.

Pure and thread-unsafe (the caller holds a lock). Fed by KV events: an engine announces a block
by its own *engine hash*, its parent's engine hash and its token ids; the index computes the
block's *router hash* (:mod:`.hashing`) from the parent's router hash and the tokens, so a
request's hash chain can be looked up without reproducing any engine's hash function.

Sources: an instance by its name (its local tiers: GPU, CPU offload; events with locality None
or ``LOCAL``), and :data:`POOL`, the shared pool (kvconnect's store): events with ownership
``kvconnect`` or locality ``REMOTE`` from any instance, and the store's own events, which carry
hashes but no tokens (:meth:`PrefixIndex.stored_hashes`). Engine hashes are kept per source;
the pool's are fleet-wide (kvconnect's pool keys are, and the connector checks the fleet's
hash seeds agree). An engine hash given as bytes is keyed as vLLM's integer form of it (the
last 8 bytes, big-endian), so the two forms of one hash agree.

Hybrid models: pass only the events of the full-attention group (``group_idx`` None or 0);
a sliding-window or Mamba group's blocks say nothing about a reusable prefix.

Memory is bounded by ``capacity`` engine-hash entries: past it, the least recently used router
block (stored or matched by a lookup last) is dropped with all its entries. A block whose
parent was dropped or never seen cannot be placed and is counted in ``orphans``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvconnect.errors import ConfigError
from kvconnect.router.hashing import ROOT, block_hash

POOL = "<pool>"
"""The source name of the shared pool (no instance URL looks like it)."""

_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class IndexStats:
    """``entries`` engine hashes held now; ``orphans`` blocks that could not be placed (an
    unknown parent, missing tokens, a store hash no instance announced) and ``dropped`` entries
    dropped to stay within capacity, both since the index was built."""

    entries: int
    orphans: int
    dropped: int


def _key(engine_hash: bytes | int) -> int:
    if isinstance(engine_hash, bytes):
        return int.from_bytes(engine_hash, "big") & _MASK
    return engine_hash & _MASK


@dataclass(slots=True)
class _Entry:
    router_hash: int
    media: set[str | None]  # the source's tiers holding it (one label for the pool)


class PrefixIndex:
    """Engine-hash entries per source, and the sources holding each router block."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"capacity must be at least 1, got {capacity}")
        self._capacity = capacity
        self._entries: dict[str, dict[int, _Entry]] = {}
        self._holders: OrderedDict[int, dict[str, set[int]]] = OrderedDict()  # LRU first
        self._size = 0
        self._orphans = 0
        self._dropped = 0

    def stored(
        self,
        source: str,
        engine_hashes: Sequence[bytes | int],
        parent: bytes | int | None,
        token_ids: Sequence[int],
        block_size: int,
        extra: bytes,
        pool: bool,
        *,
        medium: str | None = None,
    ) -> None:
        """Blocks ``engine_hashes`` (consecutive, ``block_size`` tokens each from ``token_ids``,
        the first a child of ``parent``, None for a prompt's first block) are held by ``source``
        on ``medium`` (by the pool when ``pool``). ``block_size`` and ``extra`` must be those the
        router chains requests with. Idempotent: a block announced again is refreshed."""
        owner = POOL if pool else source
        parent_hash = ROOT if parent is None else self._router_hash(owner, source, _key(parent))
        for position, engine_hash in enumerate(engine_hashes):
            tokens = token_ids[position * block_size : (position + 1) * block_size]
            if parent_hash is None or len(tokens) < block_size:
                self._orphans += len(engine_hashes) - position
                break
            parent_hash = block_hash(parent_hash, tokens, extra)
            self._add(owner, _key(engine_hash), parent_hash, None if pool else medium)
        self._shrink()

    def stored_hashes(self, engine_hashes: Iterable[bytes | int]) -> None:
        """The store's events (hashes, no tokens): a hash some source announced with its tokens
        now also marks the pool; an unknown one is counted in ``orphans``."""
        for engine_hash in engine_hashes:
            key = _key(engine_hash)
            router_hash = self._anywhere(key)
            if router_hash is None:
                self._orphans += 1
                continue
            self._add(POOL, key, router_hash, None)
        self._shrink()

    def removed(
        self,
        source: str,
        engine_hashes: Iterable[bytes | int],
        pool: bool,
        *,
        medium: str | None = None,
    ) -> None:
        """``source`` (the pool when ``pool``) no longer holds these blocks on ``medium``; a
        block stays held while another tier of the source holds it. Unknown hashes are ignored."""
        owner = POOL if pool else source
        entries = self._entries.get(owner, {})
        for engine_hash in engine_hashes:
            key = _key(engine_hash)
            entry = entries.get(key)
            if entry is None:
                continue
            entry.media.discard(None if pool else medium)
            if not entry.media:
                self._remove(owner, key, entry.router_hash)

    def cleared(self, source: str) -> None:
        """``source`` emptied its cache (vLLM's ``AllBlocksCleared``): it holds nothing now."""
        self.drop(source)

    def drop(self, source: str) -> None:
        """Forget everything ``source`` holds (an instance taken out of the fleet); its events
        refill the index when it comes back."""
        for key, entry in list(self._entries.get(source, {}).items()):
            self._remove(source, key, entry.router_hash)

    def leading(self, source: str, blocks: Sequence[int]) -> int:
        """How many leading blocks of the router chain ``blocks`` ``source`` holds. The blocks
        matched count as used (least recently used blocks are dropped first)."""
        count = 0
        for router_hash in blocks:
            holders = self._holders.get(router_hash)
            if holders is None or source not in holders:
                break
            self._holders.move_to_end(router_hash)
            count += 1
        return count

    def pool_leading(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` the shared pool holds."""
        return self.leading(POOL, blocks)

    def stats(self) -> IndexStats:
        return IndexStats(entries=self._size, orphans=self._orphans, dropped=self._dropped)

    def _router_hash(self, owner: str, source: str, key: int) -> int | None:
        # A pool block's parent may be in the announcing instance's own tiers, and the reverse.
        for name in (owner, source) if owner != source else (owner, POOL):
            entry = self._entries.get(name, {}).get(key)
            if entry is not None:
                return entry.router_hash
        return None

    def _anywhere(self, key: int) -> int | None:
        for entries in self._entries.values():
            entry = entries.get(key)
            if entry is not None:
                return entry.router_hash
        return None

    def _add(self, owner: str, key: int, router_hash: int, medium: str | None) -> None:
        entry = self._entries.get(owner, {}).get(key)
        if entry is not None and entry.router_hash != router_hash:
            # The same engine hash announced with other tokens (a hash collision or another
            # extra): the latest announcement wins.
            self._remove(owner, key, entry.router_hash)
            entry = None
        if entry is None:
            entries = self._entries.setdefault(owner, {})
            entry = entries[key] = _Entry(router_hash, set())
            self._size += 1
        entry.media.add(medium)
        holders = self._holders.setdefault(router_hash, {})
        holders.setdefault(owner, set()).add(key)
        self._holders.move_to_end(router_hash)

    def _remove(self, owner: str, key: int, router_hash: int) -> None:
        entries = self._entries[owner]
        del entries[key]
        if not entries:
            del self._entries[owner]
        self._size -= 1
        holders = self._holders[router_hash]
        keys = holders[owner]
        keys.discard(key)
        if not keys:
            del holders[owner]
            if not holders:
                del self._holders[router_hash]

    def _shrink(self) -> None:
        while self._size > self._capacity:
            router_hash, holders = next(iter(self._holders.items()))
            for owner, keys in list(holders.items()):
                for key in list(keys):
                    self._remove(owner, key, router_hash)
                    self._dropped += 1
