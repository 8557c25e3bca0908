"""The shared prefix pool: store keys of vLLM blocks, where a rank's bytes sit in a block's
object, the scheduler side's lookup, and the fleet probe.

A block is ONE store object per KV-cache group, written as parts by the TP ranks: rank ``r`` of
``n`` stores the ranges of the group's layers x chunks of the block, in that order, at ``r x
part_bytes`` (every rank's part has the same size: the pool is refused otherwise, see
:func:`fleet_keys`). In hybrid models a group's object exists only where the group saved the block
(a sliding window: near the end of a prompt); a hit is what every group can use
(:func:`~kvconnect.vllm.groups.usable_hit`). The key is vLLM's block hash (chained over the prefix,
so a key names the whole prefix up to its block; vLLM mixes LoRA adapters, multimodal inputs and
cache salts into it) plus what makes bytes interchangeable: the model and the compatibility hash of
the ranks' KV format (engine version, revision, dtype, block size, TP size, attention backend,
layout, every layer's shape).

vLLM seeds its block hashes (``NONE_HASH``: ``PYTHONHASHSEED``, or a random seed per process
with the non-cryptographic hash algorithms) and lets each instance pick its hash algorithm;
instances that disagree never hit each other's blocks. The fleet probe — an object holding
the hash of a fixed block under the fleet's keys, in the home cluster only (a peer
cluster's fleet is another fleet) — makes that an ERROR instead.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvconnect.errors import StoreError
from kvconnect.store.client import Span, StoreClient
from kvconnect.store.messages import MAX_BATCH, Code
from kvconnect.transfer.memory import MemoryRegion
from kvconnect.vllm.groups import Group, usable_hit
from kvconnect.vllm.layout import LayerLayout, RankLayout, block_ranges

log = logging.getLogger(__name__)

_FIRST_READ_PAUSE, _LAST_READ_PAUSE = 0.01, 0.5  # seconds: reading another writer's probe

PROBE_TOKENS = 16
"""Tokens of the fleet probe's block: token ids 0, 1, ... (its own length, whatever the block
size, so every instance of a fleet hashes the same tokens)."""


@dataclass(frozen=True, slots=True)
class PoolKeys:
    """Key scheme of one engine's blocks (the same for every rank and every instance of a
    fleet)."""

    prefix: str

    def block_key(self, block_hash: str, group: int = 0) -> str:
        """The object of block ``block_hash`` of KV-cache group ``group``."""
        return f"{self.prefix}{block_hash}/g{group}"

    @property
    def probe_key(self) -> str:
        """The fleet probe's object."""
        return f"{self.prefix}fleet-probe"

    def block_of(self, key: str) -> str | None:
        """The block hash a key of this scheme belongs to (the inverse of
        :meth:`block_key`, whatever the group), or None for a key of another scheme (or the
        fleet probe)."""
        if not key.startswith(self.prefix):
            return None
        block_hash, slash, _part = key[len(self.prefix) :].partition("/")
        return block_hash if slash and block_hash else None


def pool_keys(*, namespace: str, model: str, compat: str) -> PoolKeys:
    """The key scheme of an engine whose ranks share the compatibility hash ``compat``."""
    space = f"{namespace}/" if namespace else ""
    return PoolKeys(f"{space}vllm/{model.replace('/', '--')}/{compat[:32]}/")


def fleet_keys(*, namespace: str, layouts: Mapping[int, RankLayout]) -> PoolKeys | None:
    """The key scheme of an engine with these ranks' layouts (the model the workers name, as
    their keys do), or None (logged as an ERROR) when the ranks' blocks differ in format:
    their parts would not fit one object."""
    compats = {layout.compat for layout in layouts.values()}
    if len(compats) != 1:
        log.error(
            "kvconnect pool disabled: the TP ranks' KV formats differ (%s), so a block's "
            "parts cannot share one object",
            sorted(compats),
        )
        return None
    model = next(iter(layouts.values())).format.model
    return pool_keys(namespace=namespace, model=model, compat=compats.pop())


@dataclass(frozen=True, slots=True)
class BlockPart:
    """Where one rank's bytes sit in a block's object."""

    part: int
    parts: int
    part_bytes: int

    @property
    def object_bytes(self) -> int:
        return self.parts * self.part_bytes

    @property
    def object_offset(self) -> int:
        return self.part * self.part_bytes


def block_part(layers: Sequence[LayerLayout], tp_rank: int, tp_size: int) -> BlockPart:
    """Rank ``tp_rank``'s part of a block of the KV-cache group of ``layers``: every layer's
    chunks, in order."""
    return BlockPart(tp_rank, tp_size, sum(layer.chunks * layer.block_bytes for layer in layers))


def block_spans(
    layers: Sequence[LayerLayout], regions: Mapping[int, MemoryRegion], block: int
) -> list[Span]:
    """A rank's ranges of ``block`` (an id of the group of ``layers``) in its part's order:
    layer by layer, chunk by chunk (``regions``: the registered regions by id)."""
    return [
        Span(regions[layer.region], offset, size)
        for layer in layers
        for offset, size in block_ranges(layer, (block,))
    ]


class Verdict(enum.Enum):
    """What the fleet probe says about this instance's block hashes."""

    UNKNOWN = enum.auto()  # not asked yet, or the store could not answer: ask again
    AGREE = enum.auto()
    DIFFER = enum.auto()  # the pool is refused


class StorePoolIndex:
    """Looks blocks up in the store: one master call per lookup (blocking: the scheduler side
    calls it from its lookup thread, :mod:`kvconnect.vllm.lookup`)."""

    def __init__(
        self,
        client: StoreClient,
        probe: Callable[[], bytes | None] | None = None,
        *,
        groups: Sequence[Group],
        block_size: int,
    ) -> None:
        """``probe``: this instance's hash of the fleet probe's block, None until vLLM seeded
        its hashes (no ``probe``: not checked);
        ``groups``: the engine's KV-cache groups."""
        self._client = client
        self._probe = probe
        self._groups = tuple(groups)
        self._block_size = block_size
        self.keys: PoolKeys | None = None
        """The engine's key scheme, set once the workers described their KV cache; until
        then every lookup misses."""
        self.verdict = Verdict.UNKNOWN if probe is not None else Verdict.AGREE
        self._unanswered = False  # the last probe got no answer (warned once per outage)
        self._probing = threading.Lock()

    def leading(self, hashes: Sequence[str], first: int) -> int:
        """Blocks from the first (block ``first`` of the prompt) that the pool holds usably
        for every KV-cache group (:func:`~kvconnect.vllm.groups.usable_hit`; a group's object
        counts once every rank's part is in: a partial object is not visible). 0 when the
        store cannot be asked (the client's breaker makes that fast while the store is down)
        or the fleet probe refused the pool."""
        keys = self.keys
        if keys is None or not hashes or not self.check_fleet():
            return 0
        groups = len(self._groups)
        # One master call, within its batch limit: blocks past it count as misses.
        hashes = hashes[: MAX_BATCH // groups]
        names = [keys.block_key(h, g) for h in hashes for g in range(groups)]
        try:
            found = self._client.batch_exists(names)
        except StoreError as exc:
            log.debug("pool lookup failed, treating as a miss: %s", exc)
            return 0

        def stored(group: int, position: int) -> bool:
            return found[(position - first) * groups + group]

        return usable_hit(self._groups, first, len(hashes), stored, self._block_size)

    def check_fleet(self) -> bool:
        """Whether this instance's block hashes agree with the fleet's (asking the store until
        it could tell: the first instance stores the probe, the others compare theirs). Blocks
        for up to the store client's timeouts; called from the lookup lane only."""
        with self._probing:  # the lookup lane and the startup probe (PoolLookups.settle)
            if self.verdict is not Verdict.UNKNOWN or self.keys is None or self._probe is None:
                return self.verdict is Verdict.AGREE
            mine = self._probe()
            if mine is None:  # vLLM has not seeded its hashes yet
                return False
            self.verdict, why = _probe_fleet(self._client, self.keys.probe_key, mine)
            if self.verdict is Verdict.AGREE:
                log.info("kvconnect pool: this instance's block hashes agree with the fleet's")
            elif self.verdict is Verdict.UNKNOWN and not self._unanswered:
                log.warning("kvconnect pool: the fleet probe got no answer (%s); asking again", why)
            self._unanswered = self.verdict is Verdict.UNKNOWN
            return self.verdict is Verdict.AGREE


def _probe_fleet(client: StoreClient, key: str, mine: bytes) -> tuple[Verdict, str]:
    """The verdict, and why the store could not tell (UNKNOWN). The probe is the home
    cluster's fleet's: never read from or copied to a peer cluster (federation), whose fleet
    may hash otherwise and whose probe would then refuse or admit this one wrongly."""
    stored = client.put(key, mine, peers=False)
    if stored is Code.BUSY:  # a fleet starting together: another instance is writing it now
        log.debug("kvconnect pool: another instance is writing the fleet probe; reading theirs")
        theirs = _read_when_written(client, key)
        if theirs is None:
            return Verdict.UNKNOWN, "storing the probe: BUSY, and no other instance's came in time"
    elif stored not in (Code.OK, Code.EXISTS):  # the store is down
        return Verdict.UNKNOWN, f"storing the probe: {stored.name}"
    else:
        theirs = client.get(key, peers=False)
        if theirs is None:
            return Verdict.UNKNOWN, "reading the probe back failed"
    if bytes(theirs) == mine:
        return Verdict.AGREE, ""
    log.error(
        "kvconnect pool refused: this instance's block hashes differ from the fleet's (the "
        "probe %s holds another hash of the same block), so no block would ever hit. Give "
        "every instance the same PYTHONHASHSEED and --prefix-caching-hash-algo (a "
        "non-cryptographic algorithm without PYTHONHASHSEED seeds every process at random)",
        key,
    )
    return Verdict.DIFFER, ""


def _read_when_written(client: StoreClient, key: str) -> bytearray | None:
    """``key``'s value once another writer's put of it completed, asking again with a growing
    pause for up to the client's I/O timeout (a put of a few bytes that takes longer stalled:
    the caller asks again later); None past it."""
    deadline = time.monotonic() + client.config.io_timeout
    pause = _FIRST_READ_PAUSE
    while True:
        theirs = client.get(key, peers=False)
        if theirs is not None or time.monotonic() + pause > deadline:
            return theirs
        time.sleep(pause)
        pause = min(2 * pause, _LAST_READ_PAUSE)
