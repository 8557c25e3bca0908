"""Segment descriptors in etcd, kept alive by a lease and followed with a watch.

Layout: ``/kvconnect/segments/<name>`` holds the encoded :class:`SegmentDescriptor`, attached to
a lease of ``ttl`` seconds that a keepalive thread refreshes every ``ttl / 3`` seconds. An engine
that dies without withdrawing (SIGKILL, lost host) stops refreshing, so etcd deletes its
descriptor within about ``ttl`` seconds; peers then get SegmentNotFound instead of dialing a
dead address.

Restarts and outages of etcd: etcd keeps leases across its own restarts, so the keepalive
usually just resumes. If etcd did lose the lease (it expired while we could not reach etcd, or
etcd lost its data), the next refresh reports it and the keepalive grants a new lease and puts
the descriptor again. While etcd is unreachable the keepalive keeps trying; ``publish`` does not
fail then either: the keepalive writes the newest descriptor once etcd answers.

Changes: a prefix watch (:meth:`kvconnect.etcd.Etcd.watch_prefix`, which survives etcd restarts)
calls ``on_change(name)`` for every put or delete of a segment. When etcd compacted the changes
the watch missed, we cannot know which segments changed, so ``on_change`` is called for every
name :meth:`EtcdMetadata.lookup` was asked for: those are the only descriptors a consumer (the
engine's cache) can hold.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import threading
import time
from collections.abc import Callable

from kvconnect.errors import (
    ClosedError,
    ConfigError,
    CoordinationUnavailable,
    ProtocolError,
    SegmentNotFound,
)
from kvconnect.etcd import Etcd, WatchEvent, parse_url
from kvconnect.transfer.segment import SegmentDescriptor, decode_descriptor, encode_descriptor

log = logging.getLogger(__name__)

PREFIX = "/kvconnect/segments/"
"""etcd key prefix of segment descriptors (the segment name follows it)."""

_RETRY = 0.5  # seconds between keepalive attempts while etcd fails (capped at ttl / 3)
_WARN_EVERY = 5.0  # seconds between WARNING lines about an unreachable etcd
_CALLS_PER_ROUND = 5  # most etcd calls in one keepalive round (refresh, grant, create, get, put)


class EtcdMetadata:
    """Descriptors in etcd under a lease; peers' changes arrive through a watch.

    One backend publishes at most one segment (the engine's). The constructor only validates;
    :meth:`start` connects and starts the keepalive and watch threads. Every etcd call is
    bounded by ``timeout`` seconds.
    """

    def __init__(self, url: str, ttl: int = 5, timeout: float = 2.0) -> None:
        """``url``: ``etcd://host:port[,host:port…]``; ``ttl``: seconds a descriptor outlives
        its engine. Raises ConfigError for a bad URL, ``ttl < 1``, ``timeout <= 0`` or a missing
        etcd client."""
        parse_url(url)  # fail at construction, where the configuration is, not at start()
        if importlib.util.find_spec("pyetcd") is None:
            raise ConfigError("etcd metadata needs the etcd client: pip install 'kvconnect[etcd]'")
        if ttl < 1:
            raise ConfigError(f"etcd lease ttl must be >= 1 second, got {ttl!r}")
        if timeout <= 0:
            raise ConfigError(f"etcd timeout must be > 0, got {timeout!r}")
        self._url = url
        self._ttl = ttl
        self._timeout = timeout
        self._interval = ttl / 3
        self._lock = threading.Lock()  # guards _etcd, _closed, _on_change, _seen
        self._etcd: Etcd | None = None
        self._closed = False
        self._on_change: Callable[[str], None] | None = None
        self._seen: set[str] = set()
        # Our key and lease: written by publish/withdraw and the keepalive thread. The lock is
        # held across the etcd calls so that a lease replacement and a publish cannot interleave
        # (one writer of one key; nothing else waits on it).
        self._write = threading.Lock()
        self._key: str | None = None
        self._value: bytes | None = None
        self._engine_id = ""
        self._lease: int | None = None
        self._owned = False  # our key holds our descriptor under self._lease
        self._dirty = False  # etcd may lack our newest descriptor
        self._stop = threading.Event()
        self._wake = threading.Event()  # run a keepalive round now (stop, or a failed publish)
        self._keepalive: threading.Thread | None = None
        self._failing = False
        self._last_warning = -math.inf

    # --------------------------------------------------------------------------- lifecycle

    def start(self, on_change: Callable[[str], None]) -> None:
        """Connect, watch the segment prefix, start the keepalive. Blocks for at most a few
        etcd calls; raises CoordinationUnavailable if etcd does not answer, ClosedError after
        close(). ``on_change`` is called from the watch thread."""
        with self._lock:
            if self._closed:
                raise ClosedError("etcd metadata is closed")
            if self._etcd is not None:
                return
        etcd = Etcd(self._url, self._timeout)
        try:
            _items, revision = etcd.get_prefix(PREFIX)
        except BaseException:
            etcd.close()
            raise
        with self._lock:
            self._etcd = etcd
            self._on_change = on_change
        etcd.watch_prefix(PREFIX, self._on_events, revision)
        self._keepalive = threading.Thread(
            target=self._run, args=(etcd,), name="kvconnect-etcd-keepalive", daemon=True
        )
        self._keepalive.start()

    def close(self) -> None:
        """Stop the keepalive and the watch and close the connection (threads are joined).
        Idempotent. The descriptor is not removed here (see :meth:`withdraw`): if it is still
        published, it vanishes when its lease expires."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            etcd, self._etcd = self._etcd, None
        self._stop.set()
        self._wake.set()
        if self._keepalive is not None:
            self._keepalive.join(timeout=_CALLS_PER_ROUND * self._timeout + 1)
        if etcd is not None:
            etcd.close()

    # ----------------------------------------------------------------------------- segments

    def publish(self, descriptor: SegmentDescriptor) -> None:
        """Put ``descriptor`` under our lease. Blocks on etcd (at most a few calls).

        Raises ConfigError if another live engine publishes under the same name, ClosedError
        if not started. If etcd is unreachable it logs, returns, and the keepalive thread puts
        the descriptor once etcd answers (registering memory must not fail because etcd
        restarts)."""
        etcd = self._require_started()
        with self._write:
            self._key = PREFIX + descriptor.name
            self._value = encode_descriptor(descriptor)
            self._engine_id = descriptor.engine_id
            self._dirty = True
            try:
                self._write_locked(etcd)
            except CoordinationUnavailable as exc:
                self._warn(
                    "cannot publish segment %s to etcd yet (%s); retrying", descriptor.name, exc
                )
                self._wake.set()  # retry at the short interval, not a whole ttl/3 from now

    def withdraw(self, name: str) -> None:
        """Revoke our lease, which deletes our descriptor with it (and never a descriptor
        another engine published under the same name). Never raises for an unreachable etcd
        (the engine's close must go on): the descriptor then vanishes when the lease expires."""
        with self._lock:
            etcd = self._etcd
        if etcd is None:
            return
        with self._write:
            lease, self._lease = self._lease, None
            self._value = None
            self._owned = self._dirty = False
            if lease is None:
                return
            try:
                etcd.revoke(lease)
            except CoordinationUnavailable as exc:
                log.warning(
                    "could not withdraw segment %s from etcd (%s); it vanishes within %ss",
                    name,
                    str(exc),  # not the exception: see _warn
                    self._ttl,
                )

    def lookup(self, name: str, timeout: float) -> SegmentDescriptor:
        """The descriptor of segment ``name`` from etcd.

        Blocks for one etcd call, bounded by this backend's ``timeout`` (the engine passes its
        ``connect_timeout``, which is at least that). Raises SegmentNotFound if etcd has no such
        segment, CoordinationUnavailable (a BrokenError) if etcd does not answer, ProtocolError
        for a descriptor of another schema version.
        """
        etcd = self._require_started()
        with self._lock:
            # Before the read: a resync that races with it must still report this name.
            self._seen.add(name)
        value, _revision = etcd.get(PREFIX + name)
        if value is None:
            raise SegmentNotFound(f"no segment named {name!r} in etcd")
        return decode_descriptor(value)

    # ------------------------------------------------------------------------------ helpers

    def _require_started(self) -> Etcd:
        with self._lock:
            etcd = self._etcd
            closed = self._closed
        if etcd is None:
            raise ClosedError("etcd metadata is " + ("closed" if closed else "not started"))
        return etcd

    def _write_locked(self, etcd: Etcd) -> None:
        """Put our descriptor under our lease, granting one first if we have none. Holds
        ``_write``. Raises CoordinationUnavailable, or ConfigError if the name is taken."""
        if self._key is None or self._value is None:
            self._dirty = False
            return
        if self._lease is None:
            self._lease = etcd.grant(self._ttl)
            self._owned = False
        if self._owned or not self._created(etcd, self._key, self._value, self._lease):
            etcd.put(self._key, self._value, lease=self._lease)
        self._owned = True
        self._dirty = False

    def _created(self, etcd: Etcd, key: str, value: bytes, lease: int) -> bool:
        """Create ``key`` if absent. False if it exists and is ours (a put whose reply was
        lost); ConfigError if another engine's: two engines under one name would receive each
        other's transfers."""
        if etcd.create(key, value, lease) is not None:
            return True
        current, _revision = etcd.get(key)
        if current is None:
            return False
        try:
            holder = decode_descriptor(current).engine_id
        except ProtocolError:
            holder = "?"  # another kvconnect version: still not ours
        if holder != self._engine_id:
            raise ConfigError(
                f"segment name {key[len(PREFIX) :]!r} is already used by another engine in "
                f"etcd (if that engine died, its entry expires within {self._ttl}s)"
            )
        return False

    def _run(self, etcd: Etcd) -> None:
        delay = self._interval
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            if self._stop.is_set():
                return
            delay = self._interval if self._keep_alive(etcd) else min(_RETRY, self._interval)

    def _keep_alive(self, etcd: Etcd) -> bool:
        """One keepalive round; whether etcd answered and our descriptor is in place."""
        with self._write:
            if self._stop.is_set():
                return True
            try:
                if self._lease is not None and etcd.refresh(self._lease) <= 0:
                    log.info("etcd lost the lease of segment %s; publishing again", self._key)
                    self._lease = None
                    self._dirty = self._value is not None
                if self._dirty:
                    self._write_locked(etcd)
            except (CoordinationUnavailable, ConfigError) as exc:
                self._warn("etcd keepalive of segment %s failed (%s); retrying", self._key, exc)
                return False
        if self._failing:
            self._failing = False
            log.info("etcd keepalive of segment %s works again", self._key)
        return True

    def _warn(self, message: str, name: object, error: Exception) -> None:
        """WARNING at most every few seconds, DEBUG in between: an outage is one story."""
        self._failing = True
        # The text, not the exception: a buffered log record holding it would keep the
        # caller's frames alive through its traceback (e.g. memory being registered).
        args = (name, str(error))
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY:
            self._last_warning = now
            log.warning(message, *args)
        else:
            log.debug(message, *args)

    def _on_events(self, events: list[WatchEvent] | None) -> None:
        """Watch callback (watch thread): report changed segments, or all we handed out."""
        with self._lock:
            on_change = self._on_change
            if events is None:
                names = sorted(self._seen)
            else:
                names = [event.key[len(PREFIX) :] for event in events]
        if events is None:
            log.info("etcd watch lost changes; dropping %d cached segment(s)", len(names))
        if on_change is None:
            return
        for name in names:
            try:
                on_change(name)
            except Exception:  # a consumer's bug must not stop the watch
                log.exception("on_change(%r) failed", name)
