"""etcd behind a small interface: keys, leases, compare-and-create, and watches that survive
etcd restarts. The only module that imports an etcd client (``etcd-sdk-python``, import name
``pyetcd``; see docs/deployment.md for why), imported lazily.

Watches: gRPC clients lose their watches when etcd restarts. :meth:`Etcd.watch_prefix` runs a
thread that re-creates the watch from the last revision it saw; if that revision was compacted
away meanwhile it tells the callback to resynchronize (``events`` is None) and carries on.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvconnect.errors import ConfigError, CoordinationUnavailable

log = logging.getLogger(__name__)

_RETRY = 0.2  # seconds between attempts to re-create a broken watch
_LOG_EVERY = 5.0  # seconds between INFO lines about a broken watch


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A key changed: ``value`` is None for a deletion."""

    key: str
    value: bytes | None
    revision: int


def parse_url(url: str) -> list[tuple[str, int]]:
    """``etcd://host:port[,host:port…]`` to endpoints."""
    if not url.startswith("etcd://"):
        raise ConfigError(f"not an etcd URL: {url!r} (expected etcd://host:port)")
    endpoints = []
    for part in url[len("etcd://") :].split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"bad etcd endpoint {part!r} in {url!r}")
        endpoints.append((host, int(port)))
    return endpoints


class Etcd:
    """A connection to an etcd cluster; every call raises CoordinationUnavailable on failure."""

    def __init__(self, url: str, timeout: float = 2.0) -> None:
        """ConfigError for a bad URL, or when the etcd client is not installed."""
        try:
            import pyetcd
        except ImportError as exc:
            raise ConfigError(
                f"etcd ({url}) needs its client: pip install 'kvconnect[etcd]' ({exc})"
            ) from exc

        self._endpoints = parse_url(url)
        self.timeout = timeout
        # The client marks an endpoint that failed once as unusable for `time_retry` seconds
        # (300 by default): far too long for an etcd that restarts in one second.
        endpoints = [
            pyetcd.Endpoint(host, port, secure=False, time_retry=_RETRY)
            for host, port in self._endpoints
        ]
        self._client: Any = pyetcd.MultiEndpointEtcd3Client(
            endpoints=endpoints, timeout=timeout, failover=True
        )
        self._watches: list[_Watch] = []
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[bytes | None, int]:
        """The value of ``key`` (None if absent) and its create revision (0 if absent)."""
        value, meta = self._call(self._client.get, key)
        return value, (meta.create_revision if meta is not None else 0)

    def get_prefix(self, prefix: str) -> tuple[list[tuple[str, bytes]], int]:
        """Every (key, value) under ``prefix`` and the store revision of the read."""
        response = self._call(self._client.get_prefix_response, prefix)
        items = [(kv.key.decode(), kv.value) for kv in response.kvs]
        return items, int(response.header.revision)

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        """Set ``key`` (attached to ``lease`` if given)."""
        self._call(self._client.put, key, value, lease=lease)

    def create(self, key: str, value: bytes, lease: int | None = None) -> int | None:
        """Set ``key`` (attached to ``lease`` if given) only if absent; its create revision on
        success, None if it exists."""
        client = self._client
        ok, responses = self._call(
            client.transaction,
            compare=[client.transactions.create(key) == 0],
            success=[
                client.transactions.put(key, value, lease=lease),
                client.transactions.get(key),
            ],
            failure=[],
        )
        if not ok:
            return None
        return int(responses[1][0][1].create_revision)

    def delete(self, key: str) -> None:
        """Remove ``key``."""
        self._call(self._client.delete, key)

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        return int(self._call(self._client.lease, ttl).id)

    def refresh(self, lease: int) -> int:
        """Keep ``lease`` alive; its remaining TTL in seconds (0 or less: it is gone)."""
        responses = self._call(lambda: list(self._client.refresh_lease(lease)))
        return int(responses[0].TTL) if responses else 0

    def revoke(self, lease: int) -> None:
        """End ``lease`` (its keys vanish)."""
        self._call(self._client.revoke_lease, lease)

    def watch_prefix(
        self, prefix: str, callback: Callable[[list[WatchEvent] | None], None], start_revision: int
    ) -> _Watch:
        """Call ``callback`` with the changes under ``prefix`` after ``start_revision``, from a
        thread, until the returned watch is cancelled. ``None`` means: resynchronize."""
        watch = _Watch(self, prefix, callback, start_revision)
        with self._lock:
            self._watches.append(watch)
        watch.start()
        return watch

    def close(self) -> None:
        """Cancel watches, close the channel. Idempotent."""
        with self._lock:
            watches, self._watches = self._watches, []
        for watch in watches:
            watch.cancel()
        self._client.close()

    def _call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except Exception as exc:  # grpc/pyetcd raise many types; callers need one
            raise CoordinationUnavailable(f"etcd at {self._endpoints}: {exc}") from exc


class _Watch:
    """A prefix watch kept alive across etcd restarts."""

    def __init__(
        self,
        etcd: Etcd,
        prefix: str,
        callback: Callable[[list[WatchEvent] | None], None],
        start_revision: int,
    ) -> None:
        self._etcd = etcd
        self._prefix = prefix
        self._callback = callback
        self._next = start_revision + 1
        self._stop = threading.Event()
        self._cancel_current: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvconnect-etcd-watch", daemon=True)
        self._last_warning = -math.inf

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        """Stop watching and wait for the thread."""
        self._stop.set()
        with self._lock:
            cancel = self._cancel_current
        if cancel is not None:
            try:
                cancel()
            except Exception:  # the stream may be dead already
                log.debug("cancelling a broken watch", exc_info=True)
        self._thread.join(timeout=self._etcd.timeout + 2)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
            except Exception as exc:  # etcd restarted or unreachable: watch again
                self._broke(str(exc))  # the text only: a record must not keep frames alive
                if type(exc).__name__ == "RevisionCompactedError":
                    self._resync()
            self._stop.wait(_RETRY)

    def _broke(self, reason: str) -> None:
        """One line per outage at INFO (every few seconds), the retries at DEBUG."""
        now = time.monotonic()
        if now - self._last_warning >= _LOG_EVERY:
            self._last_warning = now
            log.info("etcd watch on %s broke (%s); resuming", self._prefix, reason)
        else:
            log.debug("etcd watch on %s broke (%s); resuming", self._prefix, reason)

    def _deliver(self, events: list[WatchEvent] | None) -> None:
        """Hand events to the consumer; its failure is logged, never a reason to re-watch
        (which would skip past the event)."""
        try:
            self._callback(events)
        except Exception as exc:
            log.error("etcd watch consumer of %s failed: %s", self._prefix, exc)

    def _resync(self) -> None:
        """Changes were compacted away: the consumer must reload, then we follow from now."""
        try:
            _items, revision = self._etcd.get_prefix(self._prefix)
        except CoordinationUnavailable:
            return
        self._next = revision + 1
        self._deliver(None)

    def _follow(self) -> None:
        client = self._etcd._client
        events, cancel = client.watch_prefix(self._prefix, start_revision=self._next)
        with self._lock:
            self._cancel_current = cancel
        if self._stop.is_set():
            cancel()
            return
        for event in events:
            if self._stop.is_set():
                return
            if isinstance(event, Exception):
                raise event
            value = None if type(event).__name__ == "DeleteEvent" else bytes(event.value)
            self._next = int(event.mod_revision) + 1
            self._deliver([WatchEvent(event.key.decode(), value, int(event.mod_revision))])
