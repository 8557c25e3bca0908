"""Federation: a store client reads the keys its home cluster misses from peer clusters.

Each peer cluster stays independent (its own master, store servers and token); the client
talks to it through a :class:`~kvconnect.store.client.StoreClient` of its own, whose transfer
engine proves the peer's token, and reads straight into the caller's buffers, registered with
that engine as aliases of the home engine's regions (:meth:`TransferEngine.register_alias`).

Failure isolation, per peer: a call gets at most ``share`` of the caller's remaining deadline
(and ``rpc_timeout`` for the lookup); one failed call opens the peer's breaker, and callers
then skip the peer without trying it — a background thread probes it every
``probe_interval`` and closes the breaker when it answers. Keys a peer did not have are not
asked for again for ``negative_ttl``. Home calls never wait on a peer: peers are asked only
about keys home did not have, after home answered. Writes stay home; with ``copy_home`` a key
read from a peer is copied home in the background, with ``copy_writes`` a key written home is
copied to the peer. The same background thread reports the peers' use to the home master
every ``peer_report_interval`` (``kvconnect status``); it first opens a connection to each
peer, so no caller's short peer timeout is spent on a handshake.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvconnect.errors import KVConnectError, RegionBusy, StoreError
from kvconnect.lifecycle import Lifecycle
from kvconnect.store import messages as m
from kvconnect.store.batching import BatchResult, Ranges, Span
from kvconnect.store.config import PeerConfig, StoreClientConfig
from kvconnect.store.messages import Code
from kvconnect.store.resilience import BreakerState, NegativeCache
from kvconnect.transfer import TransferConfig
from kvconnect.transfer.memory import MemoryRegion

if TYPE_CHECKING:  # the client builds its federation: no import at run time
    from kvconnect.store.client import StoreClient

log = logging.getLogger(__name__)

PutHome = Callable[[str, bytearray], Code]
"""Stores one value in the home cluster (the home client's ``put``, copied to no peer)."""
GetHome = Callable[[str], bytearray | None]
"""Reads one value from the home cluster only (the home client's ``get`` without peers)."""
ReportHome = Callable[[m.PeerReport], None]
"""Sends a report to the home master (raises StoreError when it cannot)."""


class Way(enum.Enum):
    """Which way a background copy goes."""

    HOME = "home"  # a key read from the peer, into the home cluster
    OUT = "out"  # a key written home, into the peer


_COPY_TRIES = 2
"""Attempts at one background copy: a failed one (its write not confirmed in time, a store
full for a moment) is tried again after the copies queued behind it."""

_SETTLED_FAILURES = (Code.FAILED, Code.TIMEOUT, Code.UNAVAILABLE, Code.STALE, Code.NOT_FOUND)
"""A peer's codes after which the key may still be read from the next peer (its buffer is
free again)."""


@dataclass(frozen=True, slots=True)
class PeerStatus:
    """One peer as a client sees it (``StoreClient.peers()``)."""

    name: str
    master: str
    breaker: BreakerState
    """CLOSED: asked; otherwise skipped until a background probe finds it back."""
    counts: m.PeerCounts
    """Keys asked (exists and reads) and read, bytes read, failed calls (unreachable,
    refused, timed out), keys skipped while the breaker was open, keys copied either way."""


class _Peer:
    """One peer cluster: its client (own engine, own token), negative cache and counters."""

    def __init__(self, config: PeerConfig, client: StoreClient, clock: Callable[[], float]) -> None:
        self.config = config
        self.client = client
        self.negative = NegativeCache(config.negative_ttl, config.negative_entries)
        self._clock = clock
        self._lock = threading.Lock()
        self._aliases: dict[int, tuple[MemoryRegion, MemoryRegion]] = {}
        self.counts = collections.Counter[str]()

    @property
    def up(self) -> bool:
        return self.client.breaker.state is BreakerState.CLOSED

    def count(self, **amounts: int) -> None:
        with self._lock:
            self.counts.update(amounts)

    def asking(self, keys: Sequence[str], indices: list[int]) -> list[int]:
        """Of ``indices`` into ``keys``, those to ask this peer about (up, not known absent);
        counts the others as skipped."""
        if not self.up:
            self.count(skipped=len(indices))
            return []
        absent = self.negative.failing([keys[i] for i in indices], self._clock())
        return [i for i, known in zip(indices, absent, strict=True) if not known]

    def aliases(
        self, regions: Sequence[MemoryRegion], home_owns: Callable[[MemoryRegion], bool]
    ) -> dict[int, MemoryRegion]:
        """By ``id``, each of ``regions`` (the home engine's) as registered with this peer's
        engine; aliases of home regions unregistered since are dropped first (once no
        transfer uses them)."""
        engine = self.client.engine
        with self._lock:
            for key, (home, mine) in list(self._aliases.items()):
                if not home_owns(home):
                    with contextlib.suppress(RegionBusy):  # a transfer still holds it
                        engine.unregister(mine)
                        del self._aliases[key]
            for region in regions:
                if id(region) not in self._aliases:
                    self._aliases[id(region)] = (region, engine.register_alias(region))
            return {key: self._aliases[key][1] for key in map(id, regions)}

    def status(self) -> PeerStatus:
        with self._lock:
            counts = m.PeerCounts(**self.counts)
        return PeerStatus(self.config.name, self.config.master, self.client.breaker.state, counts)

    def wants(self, way: Way) -> bool:
        """Whether this peer takes background copies going ``way``."""
        return self.config.copy_home if way is Way.HOME else self.config.copy_writes


def _use(status: PeerStatus) -> m.PeerUse:
    up = status.breaker is BreakerState.CLOSED
    return m.PeerUse(status.name, status.master, up, status.counts)


class Federation(Lifecycle):
    """The peer clusters of one store client (built by it when ``peers`` are configured)."""

    def __init__(
        self,
        config: StoreClientConfig,
        transfer: TransferConfig,
        *,
        make_client: Callable[[StoreClientConfig, TransferConfig], StoreClient],
        home_owns: Callable[[MemoryRegion], bool],
        put_home: PutHome,
        get_home: GetHome,
        report_home: ReportHome,
        client_id: str,
        clock: Callable[[], float],
    ) -> None:
        """``transfer``: the home engine's configuration, which each peer's engine takes but
        for the peer's token and metadata; ``make_client``: a client (owning its engine) from
        those; ``home_owns``: whether a region is still registered with the home engine;
        ``put_home``/``get_home``: how background copies store and read values at home;
        ``report_home``: how the peers' use reaches the home master (as ``client_id``)."""
        self._home_owns = home_owns
        self._put_home = put_home
        self._get_home = get_home
        self._report_home = report_home
        self._client_id = client_id
        self._report_interval = config.peer_report_interval
        self._clock = clock
        self._peers = [
            _Peer(peer, make_client(*_peer_configs(peer, config, transfer)), clock)
            for peer in config.peers
        ]
        self._home_hits = 0  # keys read from home by the calls that federate
        self._stop = threading.Event()
        self._wake = threading.Condition()
        self._copies: collections.deque[tuple[_Peer, str, Way, int]] = collections.deque()
        self._queued: set[tuple[str, str, Way]] = set()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the peers' engines, the prober/reporter thread and (if a peer takes copies)
        the copier. Idempotent (``with client:`` on a started client starts it again)."""
        if self._threads:
            return
        for peer in self._peers:
            peer.client.start()
        self._spawn(self._watch, "kvconnect-peer-watch")
        if any(peer.wants(way) for peer in self._peers for way in Way):
            self._spawn(self._copy, "kvconnect-peer-copy")

    def close(self) -> None:
        """Stop the threads and close the peers' clients. Idempotent."""
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        for peer in self._peers:
            peer.client.close()

    def status(self) -> list[PeerStatus]:
        """Every peer, in the configured order."""
        return [peer.status() for peer in self._peers]

    def report(self) -> m.PeerReport:
        """What the home master is told of the peers' use (counters since start)."""
        with self._wake:
            home_hits = self._home_hits
        return m.PeerReport(self._client_id, home_hits, [_use(s) for s in self.status()])

    def home_hits(self, count: int) -> None:
        """``count`` more keys of a federating call were read from home."""
        if count:
            with self._wake:
                self._home_hits += count

    def written(self, keys: Sequence[str]) -> None:
        """``keys`` were written home: queue their copies to the peers with ``copy_writes``."""
        if keys:
            for peer in self._peers:
                if peer.config.copy_writes:
                    self._enqueue(peer, keys, Way.OUT)

    # ------------------------------------------------------------------------------ lookups

    def exists(self, keys: Sequence[str], missing: list[int]) -> list[int]:
        """Of ``missing`` (indices into ``keys`` home does not have), those a peer has."""
        found: list[int] = []
        for peer in self._peers:
            asked = peer.asking(keys, missing)
            if not asked:
                continue
            names = [keys[i] for i in asked]
            peer.count(asked=len(asked))
            try:
                there = peer.client.batch_exists(names)
            except StoreError as exc:
                self._failed(peer, exc)
                continue
            peer.negative.add(
                [k for k, hit in zip(names, there, strict=True) if not hit], self._clock()
            )
            hits = {i for i, hit in zip(asked, there, strict=True) if hit}
            found += hits
            missing = [i for i in missing if i not in hits]
        return sorted(found)

    def read(
        self,
        keys: Sequence[str],
        ranges: Ranges,
        result: BatchResult,
        deadline: float,
        cancel: Callable[[], bool] | None,
    ) -> BatchResult:
        """``result`` (home's, for ``keys`` into ``ranges``) with its NOT_FOUND keys read from
        the peers, in order, each within its share of the time left. A key a peer left
        UNSETTLED is not asked further (its buffer is still held)."""
        self.home_hits(result.codes.count(Code.OK))
        if Code.NOT_FOUND not in result.codes:
            return result
        codes, sizes, unsettled = list(result.codes), list(result.sizes), list(result.unsettled)
        todo = [i for i, code in enumerate(codes) if code is Code.NOT_FOUND]
        for peer in self._peers:
            left = deadline - self._clock()
            if not todo or left <= 0 or (cancel is not None and cancel()):
                break
            asked = peer.asking(keys, todo)
            if not asked:
                continue
            got = self._read_peer(peer, keys, ranges, asked, left * peer.config.share, cancel)
            unsettled += got.unsettled
            for i, code, size in zip(asked, got.codes, got.sizes, strict=True):
                if code not in _SETTLED_FAILURES or codes[i] is Code.NOT_FOUND:
                    codes[i], sizes[i] = code, size
            todo = [i for i in todo if codes[i] in _SETTLED_FAILURES]
        return BatchResult(tuple(codes), tuple(sizes), tuple(unsettled))

    def get(self, key: str, deadline: float) -> bytearray | None:
        """``key``'s value from the first peer that has it (home did not), or None."""
        for peer in self._peers:
            left = deadline - self._clock()
            if left <= 0:
                break
            if not peer.asking([key], [0]):
                continue
            peer.count(asked=1)
            value = peer.client.get(key, timeout=left * peer.config.share)
            if value is not None:
                self._hit(peer, [key], len(value))
                return value
            if peer.up:
                peer.negative.add([key], self._clock())
            else:
                peer.count(failures=1)
        return None

    def _read_peer(
        self,
        peer: _Peer,
        keys: Sequence[str],
        ranges: Ranges,
        asked: list[int],
        timeout: float,
        cancel: Callable[[], bool] | None,
    ) -> BatchResult:
        names = [keys[i] for i in asked]
        peer.count(asked=len(asked))
        regions = {id(s.region): s.region for i in asked for s in ranges.spans[i]}
        mine = peer.aliases(list(regions.values()), self._home_owns)
        spans = [
            tuple(Span(mine[id(s.region)], s.offset, s.size) for s in ranges.spans[i])
            for i in asked
        ]
        client = peer.client
        if ranges.within is None:  # whole objects, one span per key
            got = client.batch_get_into(
                names,
                [one[0].region for one in spans],
                [one[0].offset for one in spans],
                [one[0].size for one in spans],
                timeout=timeout,
                cancel=cancel,
            )
        else:
            within = [ranges.within[i] for i in asked]
            got = client.batch_get_scattered(
                names, spans, object_offsets=within, timeout=timeout, cancel=cancel
            )
        hits = [name for name, code in zip(names, got.codes, strict=True) if code is Code.OK]
        self._hit(peer, hits, sum(got.sizes))
        absent = [n for n, code in zip(names, got.codes, strict=True) if code is Code.NOT_FOUND]
        peer.negative.add(absent, self._clock())
        if not peer.up:
            peer.count(failures=1)
        return got

    def _hit(self, peer: _Peer, keys: list[str], nbytes: int) -> None:
        peer.count(hits=len(keys), bytes_read=nbytes)
        if peer.config.copy_home and keys:
            self._enqueue(peer, keys, Way.HOME)

    def _enqueue(self, peer: _Peer, keys: Sequence[str], way: Way, tried: int = 0) -> None:
        """Queue copies of ``keys`` (``tried``: attempts at them so far)."""
        with self._wake:
            for key in keys:
                if len(self._copies) >= peer.config.copy_queue:
                    break
                if (peer.config.name, key, way) not in self._queued:
                    self._queued.add((peer.config.name, key, way))
                    self._copies.append((peer, key, way, tried))
            self._wake.notify()

    def _failed(self, peer: _Peer, exc: StoreError) -> None:
        peer.count(failures=1)
        log.info(
            "peer cluster %s failed (%s); skipped until it answers a probe", peer.config.name, exc
        )

    # ------------------------------------------------------------------ background threads

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _watch(self) -> None:
        """Connect to the peers, then probe those that are down and report to the home
        master, until closed."""
        self._connect()
        interval = min(peer.config.probe_interval for peer in self._peers) / 2
        if self._report_interval:
            interval = min(interval, self._report_interval)
        reported = self._clock()
        while not self._stop.wait(interval):
            self._probe()
            if self._report_interval and self._clock() - reported >= self._report_interval:
                reported = self._clock()
                try:
                    self._report_home(self.report())
                except StoreError as exc:
                    log.debug("peer report not taken by the home master: %s", exc)

    def _connect(self) -> None:
        """Open a connection to each peer's master before a caller needs one: a caller's
        ``rpc_timeout`` then covers its request, not a handshake too. A peer that accepts
        none within its probe interval is down from the start (callers skip it until a probe
        finds it back)."""
        for peer in self._peers:
            if self._stop.is_set():
                return
            try:
                peer.client.connect(peer.config.probe_interval)
            except StoreError as exc:
                self._failed(peer, exc)

    def _probe(self) -> None:
        """Ask each peer whose breaker is open whether it answers again (its client lets
        one call through once the cool-down, ``probe_interval``, has passed)."""
        for peer in self._peers:
            if peer.up:
                continue
            try:
                peer.client.stats()
            except StoreError as exc:
                log.debug("peer %s still down: %s", peer.config.name, exc)
            else:
                log.info("peer cluster %s answers again", peer.config.name)

    def _copy(self) -> None:
        """Copy keys read from peers into the home cluster and keys written home into peers,
        one at a time, in order; a failed copy goes once more to the back of the queue."""
        while True:
            with self._wake:
                while not self._copies and not self._stop.is_set():
                    self._wake.wait()
                if self._stop.is_set():
                    return
                peer, key, way, tried = self._copies.popleft()
                self._queued.discard((peer.config.name, key, way))
            why = self._copy_one(peer, key, way)
            if not why:
                peer.count(copied=1)
            elif tried + 1 < _COPY_TRIES:
                self._enqueue(peer, [key], way, tried + 1)
            else:  # dropped: the next read of it from the peer queues it again
                name = peer.config.name
                log.debug("copy of %s (peer %s, %s) failed: %s", key, name, way.value, why)

    def _copy_one(self, peer: _Peer, key: str, way: Way) -> str:
        """Read ``key`` where it is and write it where it goes: '' when it is there now, else
        why not."""
        try:
            if way is Way.HOME:
                value = peer.client.get(key)
                code = None if value is None else self._put_home(key, value)
            else:
                value = self._get_home(key)
                code = None if value is None else peer.client.put(key, value)
        except KVConnectError as exc:  # e.g. a registration refused: the copy fails, not the copier
            return f"{type(exc).__name__}: {exc}"
        if code is None:
            return "not read"
        # EXISTS: there already (also a retried write that was stored, unconfirmed in time)
        return "" if code in (Code.OK, Code.EXISTS) else code.name


def _peer_configs(
    peer: PeerConfig, home: StoreClientConfig, transfer: TransferConfig
) -> tuple[StoreClientConfig, TransferConfig]:
    """A peer's client settings: the home client's but for its master, a breaker that opens
    on the first failure (cool-down: the probe interval) and no peers of its own; its
    engine's: the home engine's but for the peer's token and metadata (and a listener on any
    free port, named after it)."""
    client = home.replace(
        master=peer.master,
        rpc_timeout=peer.rpc_timeout,
        breaker_failures=1,
        breaker_cooldown=peer.probe_interval,
        peers=(),
    )
    engine = transfer.replace(
        token=peer.cluster_token(),
        token_file="",
        insecure=peer.insecure,
        name=None,
        listen_port=0,
        metadata=peer.metadata,
    )
    return client, engine
