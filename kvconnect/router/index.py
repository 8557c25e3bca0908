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

Memory is bounded by ``capacity`` engine-hash entries (a few hundred bytes each): past it, the
least recently used router block (stored or matched by a lookup last) is dropped with all its
entries. A block whose parent was dropped or never seen cannot be placed and is counted in
``orphans``. One engine hash per block and source is kept (the latest announced): engines that
hash more than the router chains (multimodal inputs) may announce two for one router block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvconnect.errors import ConfigError
from kvconnect.router.hashing import ROOT, chain

POOL = "<pool>"
"""The source name of the shared pool (no instance URL looks like it)."""

_MASK = (1 << 64) - 1
_TIERS = 8  # low bits of an entry's packed int: the tiers of the source holding it
_TIER_MASK = (1 << _TIERS) - 1


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


class PrefixIndex:
    """Engine-hash entries per source, and the sources holding each router block."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"capacity must be at least 1, got {capacity}")
        self._capacity = capacity
        # per source: engine key -> router hash << _TIERS | tier bits, and router hash -> key
        self._entries: dict[str, dict[int, int]] = {}
        self._keys: dict[str, dict[int, int]] = {}
        self._lru: OrderedDict[int, int] = OrderedDict()  # router hash -> holders, LRU first
        self._tiers: dict[str | None, int] = {}
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
        if parent_hash is None:
            self._orphans += len(engine_hashes)
            return
        tokens = token_ids[: len(engine_hashes) * block_size]
        router_hashes = chain(tokens, block_size, extra, parent=parent_hash)
        self._orphans += len(engine_hashes) - len(router_hashes)  # those without their tokens
        tier = self._tier(None if pool else medium)
        for engine_hash, router_hash in zip(engine_hashes, router_hashes, strict=False):
            self._add(owner, _key(engine_hash), router_hash, tier)
        self._shrink()

    def stored_hashes(self, engine_hashes: Iterable[bytes | int]) -> None:
        """The store's events (hashes, no tokens): a hash some source announced with its tokens
        now also marks the pool; an unknown one is counted in ``orphans``."""
        tier = self._tier(None)
        for engine_hash in engine_hashes:
            key = _key(engine_hash)
            router_hash = self._anywhere(key)
            if router_hash is None:
                self._orphans += 1
                continue
            self._add(POOL, key, router_hash, tier)
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
        tier = self._tier(None if pool else medium)
        for engine_hash in engine_hashes:
            key = _key(engine_hash)
            packed = self._entries.get(owner, {}).get(key)
            if packed is None:
                continue
            if packed & _TIER_MASK & ~tier:
                self._entries[owner][key] = packed & ~tier
            else:
                self._remove(owner, key)

    def cleared(self, source: str) -> None:
        """``source`` emptied its cache (vLLM's ``AllBlocksCleared``): it holds nothing now."""
        self.drop(source)

    def drop(self, source: str) -> None:
        """Forget everything ``source`` holds (an instance taken out of the fleet); its events
        refill the index when it comes back."""
        for key in list(self._entries.get(source, {})):
            self._remove(source, key)

    def leading(self, source: str, blocks: Sequence[int]) -> int:
        """How many leading blocks of the router chain ``blocks`` ``source`` holds. The blocks
        matched count as used (least recently used blocks are dropped first)."""
        held = self._keys.get(source, {})
        count = 0
        for router_hash in blocks:
            if router_hash not in held:
                break
            self._lru.move_to_end(router_hash)
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
            packed = self._entries.get(name, {}).get(key)
            if packed is not None:
                return packed >> _TIERS
        return None

    def _anywhere(self, key: int) -> int | None:
        for entries in self._entries.values():
            packed = entries.get(key)
            if packed is not None:
                return packed >> _TIERS
        return None

    def _tier(self, medium: str | None) -> int:
        bit = self._tiers.get(medium)
        if bit is not None:
            return bit
        if len(self._tiers) == _TIERS - 1:
            return 1 << (_TIERS - 1)  # engines name a handful of tiers; any others share a bit
        bit = self._tiers[medium] = 1 << len(self._tiers)
        return bit

    def _add(self, owner: str, key: int, router_hash: int, tier: int) -> None:
        packed = self._entries.get(owner, {}).get(key)
        if packed is not None and packed >> _TIERS != router_hash:
            # The same engine hash announced with other tokens (a hash collision or another
            # extra): the latest announcement wins.
            self._remove(owner, key)
            packed = None
        other = self._keys.get(owner, {}).get(router_hash)
        if other is not None and other != key:
            self._remove(owner, other)
        if packed is None:
            self._entries.setdefault(owner, {})[key] = router_hash << _TIERS | tier
            self._keys.setdefault(owner, {})[router_hash] = key
            self._size += 1
            self._lru[router_hash] = self._lru.get(router_hash, 0) + 1
        else:
            self._entries[owner][key] = packed | tier
        self._lru.move_to_end(router_hash)

    def _remove(self, owner: str, key: int) -> None:
        entries, keys = self._entries[owner], self._keys[owner]
        router_hash = entries.pop(key) >> _TIERS
        del keys[router_hash]
        if not entries:
            del self._entries[owner], self._keys[owner]
        self._size -= 1
        holders = self._lru[router_hash] - 1
        if holders:
            self._lru[router_hash] = holders
        else:
            del self._lru[router_hash]

    def _shrink(self) -> None:
        while self._size > self._capacity:
            router_hash = next(iter(self._lru))
            for owner in list(self._keys):
                key = self._keys[owner].get(router_hash)
                if key is not None:
                    self._remove(owner, key)
                    self._dropped += 1
