"""A P2P node: publishes objects, fetches them from every node that holds part of them, and
serves what it holds to the others (docs/p2p.md).

Typical use::

    with P2PNode(P2PConfig(etcd="etcd://10.0.0.5:2379")) as node:
        node.publish(Path("/models/llama"), "llama-70b")       # on one node
        node.fetch("llama-70b", Files(Path("/cache/llama")))   # on each of the others
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from kvconnect.errors import ClosedError, P2PError, RegionBusy
from kvconnect.etcd import Etcd
from kvconnect.lifecycle import Lifecycle
from kvconnect.p2p import manifest as manifests
from kvconnect.p2p.config import P2PConfig
from kvconnect.p2p.destination import Destination, Files
from kvconnect.p2p.fetch import ChunkState, Fetch, FetchStats, Progress
from kvconnect.p2p.manifest import Manifest
from kvconnect.p2p.registry import (
    HOLDER_SCHEMA,
    Announcer,
    HolderRecord,
    HolderView,
    Registry,
    pack_bits,
)
from kvconnect.p2p.swarm import Bits, Place
from kvconnect.transfer import TransferEngine
from kvconnect.transfer.segment import host_identity

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Listing:
    """A published object and how many nodes hold it whole or in part now."""

    manifest: Manifest
    complete: int
    partial: int


class _Held:
    """An object this node serves: its destination, regions and verified chunks."""

    def __init__(
        self,
        manifest: Manifest,
        destination: Destination,
        have: Bits,
        regions: tuple[int, ...],
        segment: str,
        place: Place,
    ) -> None:
        self.manifest = manifest
        self.destination = destination
        self._have = have
        self._fetching = np.zeros_like(have)
        self._regions = regions
        self._segment = segment
        self._place = place
        self._lock = threading.Lock()

    def have(self) -> Bits:
        """A copy of the verified chunks."""
        with self._lock:
            return self._have.copy()

    def note(self, chunk: int, state: ChunkState) -> None:
        """What a fetch did with ``chunk``."""
        with self._lock:
            self._fetching[chunk] = state is ChunkState.FETCHING
            self._have[chunk] |= state is ChunkState.STORED

    def record(self) -> bytes:
        with self._lock:
            have, fetching = pack_bits(self._have), pack_bits(self._fetching)
        place = (self._place.host, self._place.locality, self._place.address)
        record = HolderRecord(HOLDER_SCHEMA, self._segment, place, self._regions, have, fetching)
        return msgspec.msgpack.encode(record)


class P2PNode(Lifecycle):
    """One process's member of a P2P swarm. ``start()`` connects to etcd and starts the
    transfer engine; every method blocks and may raise CoordinationUnavailable (etcd),
    P2PError, ConfigError or OSError (files); ``close()`` stops serving (its holder records
    vanish with its lease). Thread-safe."""

    def __init__(self, config: P2PConfig) -> None:
        self.config = config
        self._engine = TransferEngine(config.transfer)
        self._etcd: Etcd | None = None
        self._registry: Registry | None = None
        self._announcer: Announcer | None = None
        self._held: dict[tuple[str, str], _Held] = {}
        self._fetching: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._place = Place("", "", "")

    def start(self) -> None:
        """Start the engine, connect to etcd, start announcing; on any failure what started
        is closed again (ConfigError without the etcd client)."""
        try:
            self._engine.start()
            self._etcd = Etcd(self.config.etcd)
            self._registry = Registry(self._etcd, self.config.prefix)
            self._announcer = Announcer(
                self._etcd, self.config.lease_ttl, self.config.announce_interval
            )
            self._announcer.start()
        except BaseException:
            self.close()
            raise
        address = self._engine.name.rpartition(":")[0]
        self._place = Place(host_identity(), self.config.locality, address)

    @property
    def segment(self) -> str:
        """This node's transfer segment (how holders are named in etcd)."""
        return self._engine.name

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            raise ClosedError("the P2P node is not started")
        return self._registry

    def publish(self, root: Path, name: str, version: str | None = None) -> Manifest:
        """Hash the files under ``root`` into chunks, publish the manifest (``version``
        None: named by content) and serve them."""
        manifest = manifests.build(root, name, version, self.config.chunk_bytes)
        self.registry.publish(manifest)
        with self._lock:
            served = (manifest.name, manifest.version) in self._held
        if not served:  # publishing the same content again: it is served already
            self.serve(manifest, Files(root, source=True), announce=True)
        log.info(
            "published %s version %s: %d files, %d chunks",
            name,
            manifest.version,
            len(manifest.files),
            manifest.chunk_count,
        )
        return manifest

    def serve(self, manifest: Manifest, destination: Destination, *, announce: bool) -> Bits:
        """Open ``destination`` for ``manifest``'s object (files are hashed) and, with
        ``announce``, serve the verified chunks it holds (and those stored later); returns
        which chunks it holds. Serving an object again from the same destination is a no-op;
        from another one, a P2PError (a node holds an object in one place)."""
        key = (manifest.name, manifest.version)
        with self._lock:
            held = self._held.get(key)
        if held is not None:
            if held.destination is not destination:
                raise P2PError(
                    f"this node holds {manifest.name} version {manifest.version} elsewhere"
                )
            return held.have()
        have, regions = destination.open(manifest, self._engine)
        held = _Held(manifest, destination, have, regions, self.segment, self._place)
        with self._lock:
            self._held[key] = held
        if announce:
            self._holders().set(self._record_key(manifest), held.record)
        return have.copy()

    def fetch(
        self,
        name: str,
        destination: Destination,
        version: str | None = None,
        *,
        progress: Progress | None = None,
        timeout: float | None = None,
    ) -> tuple[Manifest, FetchStats]:
        """Fetch ``name`` (its latest version by default) into ``destination`` from every
        node that holds part of it, and serve it as it arrives and after (unless the node
        does not ``share``). Chunks ``destination`` already holds verified are kept.
        ``progress`` is called about twice a second from this thread. Raises P2PError if it
        cannot complete (``timeout``, a stall) or the object is being fetched already."""
        manifest = self.registry.manifest(name, version)
        key = (manifest.name, manifest.version)
        with self._lock:
            if key in self._fetching:
                raise P2PError(f"{name} version {manifest.version} is being fetched already")
            self._fetching.add(key)
        try:
            return self._fetch(manifest, destination, progress, timeout)
        finally:
            with self._lock:
                self._fetching.discard(key)

    def _fetch(
        self,
        manifest: Manifest,
        destination: Destination,
        progress: Progress | None,
        timeout: float | None,
    ) -> tuple[Manifest, FetchStats]:
        have = self.serve(manifest, destination, announce=self.config.share)
        held = self._held[(manifest.name, manifest.version)]
        own = self._record_key(manifest)

        def note(chunk: int, state: ChunkState) -> None:
            held.note(chunk, state)
            self._holders().touch(own)

        fetch = Fetch(self.config, self._engine, manifest, destination, have, self._place, note)
        view = HolderView(
            self.registry,
            manifest,
            lambda key, record: None if key == own else fetch.holder(key, record),
        )
        try:
            stats = fetch.run(progress, timeout)
        finally:
            view.close()
            try:
                fetch.close()
            except RegionBusy:
                log.debug("a late READ still holds the staging buffer: the engine frees it")
        return manifest, stats

    def listing(self) -> list[Listing]:
        """Every published object with its holders now."""
        found = []
        for manifest in self.registry.manifests():
            records, _ = self.registry.holders(manifest)
            complete = sum(bool(r.bits(manifest.chunk_count)[0].all()) for r in records.values())
            found.append(Listing(manifest, complete, len(records) - complete))
        return found

    def _holders(self) -> Announcer:
        if self._announcer is None:
            raise ClosedError("the P2P node is not started")
        return self._announcer

    def _record_key(self, manifest: Manifest) -> str:
        return self.registry.holders_prefix(manifest.name, manifest.version) + self.segment

    def close(self) -> None:
        """Stop serving: revoke the lease (records vanish), stop the engine, close files.
        Idempotent."""
        if self._announcer is not None:
            self._announcer.close()
            self._announcer = None
        self._engine.close()
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for item in held:
            item.destination.close()
        if self._etcd is not None:
            self._etcd.close()
            self._etcd = None
