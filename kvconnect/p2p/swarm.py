"""Which chunk to fetch next, and from whom: the pure scheduling state of one fetch (no I/O,
no threads; time is passed in).

The choice, for every free transfer slot:

1. chunks still needed, not in flight, held by a holder that may take one more transfer;
2. among them those the *nearest* such holder has (same host, then same place, then any):
   a node near a full copy takes everything from it, and racks stay apart;
3. then the rarest (fewest holders, counting the fetchers that are fetching it now): copies
   that exist once are copied first, and a chunk another fetcher is already taking from its
   only holder is left for later, so a publisher's bytes go out about once and the swarm
   serves the rest (BitTorrent's rarest first, with in-flight claims);
4. ties in a random order of this fetch's own, so fetchers that start together ask the
   publisher for different chunks;
5. the holder: the nearest, then the one this fetch is reading least from, then the one
   holding least (a partial holder's link is idle when few can ask it; a full copy is asked
   by everyone), then at random.

A holder that failed a transfer is left alone for ``retry_after`` seconds; one that served a
chunk whose digest did not match is never asked again by this fetch.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

Bits = npt.NDArray[np.bool_]


class Proximity(enum.IntEnum):
    """How near a holder is; lower is preferred."""

    HOST = 0
    PLACE = 1
    ANY = 2


LONE_DEPTH = 2  # transfers from a holder that no one else reads from
_NONE = len(Proximity)  # beyond every proximity: no eligible holder has the chunk


class Place(NamedTuple):
    """Where a node is: its host identity, configured locality and advertised address."""

    host: str
    locality: str
    address: str


def proximity(mine: Place, theirs: Place) -> Proximity:
    """HOST for the same host; PLACE for the same configured locality, or, when neither
    names one, the same IPv4 /24; ANY otherwise."""
    if mine.host == theirs.host:
        return Proximity.HOST
    if mine.locality or theirs.locality:
        return Proximity.PLACE if mine.locality == theirs.locality else Proximity.ANY
    return Proximity.PLACE if _subnet(mine.address) == _subnet(theirs.address) else Proximity.ANY


def _subnet(address: str) -> object:
    try:
        return ipaddress.ip_network(f"{address}/24", strict=False)
    except ValueError:
        return address  # a name: only equal names count as near


class Failure(enum.Enum):
    """Why a chunk did not arrive from a holder."""

    UNREACHABLE = "unreachable"  # the transfer failed or timed out: retry it later
    CORRUPT = "corrupt"  # its bytes did not match the digest: never ask it again


class Assignment(NamedTuple):
    chunk: int
    holder: str


@dataclass(slots=True)
class _Holder:
    proximity: Proximity
    have: Bits
    fetching: Bits
    busy: int = 0
    banned: bool = False
    resume_at: float = 0.0


@dataclass(slots=True)
class Swarm:
    """One fetch's view of the chunks it needs and the holders it may read them from."""

    chunks: int
    per_holder: int
    retry_after: float
    seed: int | None = None
    _needed: Bits = field(init=False)
    _inflight: Bits = field(init=False)
    _rank: npt.NDArray[np.int64] = field(init=False)
    _holders: dict[str, _Holder] = field(init=False, default_factory=dict)
    _rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        self._needed = np.ones(self.chunks, dtype=bool)
        self._inflight = np.zeros(self.chunks, dtype=bool)
        self._rank = self._rng.permutation(self.chunks)

    # ---------------------------------------------------------------------------- state

    def have(self, chunk: int) -> None:
        """``chunk`` is here already (verified before the fetch started)."""
        self._needed[chunk] = False

    def holder(self, name: str, near: Proximity, have: Bits, fetching: Bits) -> None:
        """Add holder ``name`` or update what it has and is fetching (its failures are
        kept)."""
        if have.shape != (self.chunks,) or fetching.shape != (self.chunks,):
            raise ValueError(f"a holder's bitmaps are not of {self.chunks} bits")
        known = self._holders.get(name)
        if known is None:
            self._holders[name] = _Holder(near, have.copy(), fetching.copy())
        else:
            known.proximity, known.have, known.fetching = near, have.copy(), fetching.copy()

    def drop(self, name: str) -> None:
        """Holder ``name`` is gone (its transfers in flight still end with done/failed)."""
        known = self._holders.get(name)
        if known is not None:
            known.have = np.zeros(self.chunks, dtype=bool)
            known.fetching = np.zeros(self.chunks, dtype=bool)

    @property
    def missing(self) -> int:
        """Chunks not here yet (in flight included)."""
        return int(self._needed.sum())

    @property
    def complete(self) -> bool:
        return not self._needed.any()

    def in_flight(self) -> int:
        return int(self._inflight.sum())

    def unavailable(self) -> int:
        """Needed chunks no holder that may still be asked has (stuck unless one appears)."""
        usable = [h.have for h in self._holders.values() if not h.banned]
        held = np.logical_or.reduce(usable) if usable else np.zeros(self.chunks, dtype=bool)
        return int((self._needed & ~held).sum())

    # ------------------------------------------------------------------------- choices

    def next(self, now: float) -> Assignment | None:
        """The next chunk to fetch and its holder, marked in flight; None when every
        needed chunk is in flight or no holder that may take a transfer now has one."""
        limit = self._per_holder()
        names = [
            name
            for name, h in self._holders.items()
            if not h.banned and h.resume_at <= now and h.busy < limit
        ]
        wanted = self._needed & ~self._inflight
        if not names or not wanted.any():
            return None
        eligible = np.stack([self._holders[n].have for n in names]) & wanted
        near = np.array([self._holders[n].proximity for n in names])[:, None]
        best = np.where(eligible, near, _NONE).min(axis=0)
        if (best == _NONE).all():
            return None
        others = [h for h in self._holders.values() if not h.banned]
        rarity = np.sum([h.have for h in others], axis=0) + np.sum(
            [h.fetching for h in others], axis=0
        )
        order = np.lexsort((self._rank, rarity, best))  # last key sorts first
        chunk = int(order[0])
        who = [i for i in range(len(names)) if eligible[i, chunk]]
        keys = [self._holder_key(names[i], near[i, 0]) for i in who]
        holder = names[who[min(range(len(who)), key=keys.__getitem__)]]
        self._inflight[chunk] = True
        self._holders[holder].busy += 1
        return Assignment(chunk, holder)

    def _per_holder(self) -> int:
        """``per_holder``, or two when one node alone holds or fetches the object (this
        fetch is its only reader: a second request keeps its link busy between chunks)."""
        active = [h for h in self._holders.values() if h.have.any() or h.fetching.any()]
        return self.per_holder if len(active) > 1 else max(self.per_holder, LONE_DEPTH)

    def _holder_key(self, name: str, near: int) -> tuple[int, int, int, float]:
        holder = self._holders[name]
        return (near, holder.busy, int(holder.have.sum()), float(self._rng.random()))

    def done(self, assignment: Assignment) -> None:
        """The chunk arrived and verified."""
        self._settle(assignment)
        self._needed[assignment.chunk] = False

    def failed(self, assignment: Assignment, failure: Failure, now: float) -> None:
        """The chunk did not arrive from that holder: it is needed again."""
        self._settle(assignment)
        known = self._holders.get(assignment.holder)
        if known is None:
            return
        if failure is Failure.CORRUPT:
            known.banned = True
        else:
            known.resume_at = now + self.retry_after

    def _settle(self, assignment: Assignment) -> None:
        self._inflight[assignment.chunk] = False
        known = self._holders.get(assignment.holder)
        if known is not None:
            known.busy -= 1
