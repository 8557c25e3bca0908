"""The P2P store's metadata in etcd: manifests (permanent) and holder records (under each
node's lease, so a node that dies stops being offered), and the thread that keeps a node's
records and lease alive.

Keys, under the configured prefix ``P``::

    P m/NAME/VERSION            the manifest (msgpack, kvconnect.p2p.manifest)
    P latest/NAME               the version last published under NAME
    P h/NAME/VERSION/SEGMENT    a holder record (msgpack HolderRecord), leased

Values read back are checked: a malformed record is ignored (logged once), never trusted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import numpy as np

from kvconnect.errors import CoordinationUnavailable, P2PError, ProtocolError
from kvconnect.etcd import Etcd, WatchEvent
from kvconnect.p2p import manifest as manifests
from kvconnect.p2p.manifest import Manifest
from kvconnect.p2p.swarm import Bits, Place

log = logging.getLogger(__name__)

HOLDER_SCHEMA = 1


class HolderRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A node that serves chunks of one object: how to reach it (its transfer engine's
    segment), where it is, the region of each file (-1: none, an empty file), which chunks
    it has verified (bit i of ``have``, little-endian bit order) and which it is fetching
    now (``fetching``: other fetchers leave those for later, so a chunk that exists once is
    not sent twice by its only holder)."""

    schema: int
    segment: str
    place: tuple[str, str, str]
    regions: tuple[int, ...]
    have: bytes
    fetching: bytes

    def bits(self, chunks: int) -> tuple[Bits, Bits]:
        """``have`` and ``fetching`` as one bool per chunk each."""
        return _unpack(self.have, chunks), _unpack(self.fetching, chunks)


def _unpack(packed: bytes, chunks: int) -> Bits:
    raw = np.frombuffer(packed, dtype=np.uint8)
    return np.unpackbits(raw, count=chunks, bitorder="little").astype(bool)


def pack_bits(have: Bits) -> bytes:
    return np.packbits(have, bitorder="little").tobytes()


def decode_holder(data: bytes, manifest: Manifest) -> HolderRecord:
    """A holder record of ``manifest``'s object; ProtocolError if malformed or not for it."""
    try:
        record = msgspec.msgpack.decode(data, type=HolderRecord)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed holder record: {exc}") from exc
    if record.schema != HOLDER_SCHEMA:
        raise ProtocolError(f"holder record schema {record.schema} (expected {HOLDER_SCHEMA})")
    if len(record.regions) != len(manifest.files):
        raise ProtocolError(f"holder {record.segment} names {len(record.regions)} regions")
    packed = -(-manifest.chunk_count // 8)
    if len(record.have) != packed or len(record.fetching) != packed:
        raise ProtocolError(f"holder {record.segment} has bitmaps of the wrong size")
    return record


def place_of(record: HolderRecord) -> Place:
    return Place(*record.place)


class Registry:
    """Manifests and holder records of one swarm (etcd under ``prefix``). Blocking calls;
    each raises CoordinationUnavailable when etcd does not answer."""

    def __init__(self, etcd: Etcd, prefix: str) -> None:
        self.etcd = etcd
        self.prefix = prefix

    def manifest_key(self, name: str, version: str) -> str:
        return f"{self.prefix}m/{name}/{version}"

    def holders_prefix(self, name: str, version: str) -> str:
        return f"{self.prefix}h/{name}/{version}/"

    def publish(self, manifest: Manifest) -> None:
        """Store ``manifest`` and make it NAME's latest version. Publishing the same content
        again is a no-op; another content under a published name and version is a
        P2PError (a version names one content forever)."""
        key = self.manifest_key(manifest.name, manifest.version)
        data = manifests.encode(manifest)
        if self.etcd.create(key, data) is None:
            existing, _ = self.etcd.get(key)
            if existing is None or manifests.decode(existing) != manifest:
                raise P2PError(
                    f"{manifest.name} version {manifest.version} is published with another "
                    "content: publish under a new version"
                )
        self.etcd.put(f"{self.prefix}latest/{manifest.name}", manifest.version.encode())

    def manifest(self, name: str, version: str | None = None) -> Manifest:
        """The manifest of ``name`` (its latest version by default); P2PError if there is
        none, ProtocolError if it is malformed."""
        manifests.check_name("name", name)
        if version is None:
            latest, _ = self.etcd.get(f"{self.prefix}latest/{name}")
            if latest is None:
                raise P2PError(f"nothing is published under {name!r}")
            version = latest.decode(errors="replace")
        data, _ = self.etcd.get(self.manifest_key(name, manifests.check_name("version", version)))
        if data is None:
            raise P2PError(f"{name!r} has no version {version!r}")
        manifest = manifests.decode(data)
        if (manifest.name, manifest.version) != (name, version):
            raise ProtocolError(f"the manifest under {name}/{version} names another object")
        return manifest

    def manifests(self) -> list[Manifest]:
        """Every published manifest that reads back valid, by name and version."""
        items, _ = self.etcd.get_prefix(f"{self.prefix}m/")
        found = []
        for key, data in items:
            try:
                found.append(manifests.decode(data))
            except ProtocolError as exc:
                log.warning("ignoring %s: %s", key, exc)
        return sorted(found, key=lambda m: (m.name, m.version))

    def holders(self, manifest: Manifest) -> tuple[dict[str, HolderRecord], int]:
        """The valid holder records of ``manifest``'s object by key, and the revision read."""
        items, revision = self.etcd.get_prefix(self.holders_prefix(manifest.name, manifest.version))
        records = {}
        for key, data in items:
            record = _checked(key, data, manifest)
            if record is not None:
                records[key] = record
        return records, revision

    def delete(self, name: str, version: str) -> None:
        """Withdraw a manifest: no fetch starts on it any more (holders keep serving what
        they have until they stop, so fetches under way complete). P2PError if absent."""
        if self.etcd.get(self.manifest_key(name, version))[0] is None:
            raise P2PError(f"{name!r} has no version {version!r}")
        self.etcd.delete(self.manifest_key(name, version))
        latest, _ = self.etcd.get(f"{self.prefix}latest/{name}")
        if latest == version.encode():
            self.etcd.delete(f"{self.prefix}latest/{name}")


def _checked(key: str, data: bytes, manifest: Manifest) -> HolderRecord | None:
    try:
        return decode_holder(data, manifest)
    except ProtocolError as exc:
        log.warning("ignoring holder record %s: %s", key, exc)
        return None


class HolderView:
    """The live holder records of one object, followed through an etcd watch (re-read
    whole after etcd lost the revisions the watch needed). ``on_change`` is called from the
    watch thread with (key, record or None for a holder that went)."""

    def __init__(
        self,
        registry: Registry,
        manifest: Manifest,
        on_change: Callable[[str, HolderRecord | None], None],
    ) -> None:
        self._registry = registry
        self._manifest = manifest
        self._on_change = on_change
        self._known: set[str] = set()
        self._lock = threading.Lock()
        records, revision = registry.holders(manifest)
        self._replace(records)
        prefix = registry.holders_prefix(manifest.name, manifest.version)
        self._watch = registry.etcd.watch_prefix(prefix, self._changed, revision)

    def _changed(self, events: list[WatchEvent] | None) -> None:
        if events is None:
            try:
                records, _ = self._registry.holders(self._manifest)
            except CoordinationUnavailable:
                return  # the watch resynchronizes again once etcd answers
            self._replace(records)
            return
        for event in events:
            record = (
                None if event.value is None else _checked(event.key, event.value, self._manifest)
            )
            with self._lock:
                (self._known.add if record is not None else self._known.discard)(event.key)
            self._on_change(event.key, record)

    def _replace(self, records: dict[str, HolderRecord]) -> None:
        with self._lock:
            gone = self._known - records.keys()
            self._known = set(records)
        for key in gone:
            self._on_change(key, None)
        for key, record in records.items():
            self._on_change(key, record)

    def close(self) -> None:
        self._watch.cancel()


class Announcer:
    """Keeps this node's holder records in etcd under one lease: a thread refreshes the lease
    every third of its TTL, writes records that changed at most every ``interval`` seconds,
    and after etcd lost the lease (a long outage) takes a new one and writes every record
    again. Records are produced by their callbacks when written, so the latest state goes
    out; writes that fail are retried until they succeed or the record is removed."""

    def __init__(self, etcd: Etcd, ttl: int, interval: float) -> None:
        self._etcd = etcd
        self._ttl = ttl
        self._interval = interval
        self._records: dict[str, Callable[[], bytes]] = {}
        self._dirty: set[str] = set()
        self._lease: int | None = None
        self._refresh_at = 0.0
        self._wake = threading.Condition()
        self._stopping = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvconnect-p2p-announce", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def set(self, key: str, record: Callable[[], bytes]) -> None:
        """Keep ``key`` in etcd with the value ``record()`` (written soon)."""
        with self._wake:
            self._records[key] = record
            self._dirty.add(key)
            self._wake.notify()

    def touch(self, key: str) -> None:
        """``key``'s value changed: write it again (coalesced with other changes)."""
        with self._wake:
            if key in self._records:
                self._dirty.add(key)
                self._wake.notify()

    def close(self) -> None:
        """Stop the thread and revoke the lease (every record vanishes). Idempotent."""
        with self._wake:
            if self._stopping:
                return
            self._stopping = True
            self._stop.set()
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self._lease is not None:
            try:
                self._etcd.revoke(self._lease)
            except CoordinationUnavailable:
                log.debug("could not revoke lease %x: it expires", self._lease)

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._dirty and not self._stopping:
                    self._wake.wait(max(0.0, self._refresh_at - time.monotonic()))
                if self._stopping:
                    return
            try:
                self._keep_lease()
                self._write_dirty()
                pause = self._interval  # what changes meanwhile goes out in one write
            except CoordinationUnavailable as exc:
                log.debug("p2p announcements wait for etcd: %s", exc)
                pause = min(1.0, self._ttl / 3)
            if self._stop.wait(pause):
                return

    def _keep_lease(self) -> None:
        now = time.monotonic()
        if self._lease is not None and now < self._refresh_at:
            return
        if self._lease is not None and self._etcd.refresh(self._lease) > 0:
            self._refresh_at = now + self._ttl / 3
            return
        if self._lease is not None:
            log.info("p2p lease %x expired (etcd was away): announcing again", self._lease)
        self._lease = self._etcd.grant(self._ttl)
        self._refresh_at = now + self._ttl / 3
        with self._wake:
            self._dirty |= self._records.keys()

    def _write_dirty(self) -> None:
        with self._wake:
            pending = [(key, self._records[key]) for key in self._dirty]
            self._dirty.clear()
        for number, (key, record) in enumerate(pending):
            try:
                self._etcd.put(key, record(), lease=self._lease)
            except CoordinationUnavailable:
                with self._wake:
                    self._dirty.update(k for k, _ in pending[number:] if k in self._records)
                raise
