"""Master high availability through etcd: one leader among any number of masters.

Election: a master creates ``LEADER_KEY`` (value: its endpoint) if absent, attached to an etcd
lease of ``ttl`` seconds; the create revision of that key is the leader's *term*. The leader
refreshes the lease every ``ttl/4``. Standbys check the key every ``ttl/8`` and campaign when it
is gone (the leader died, stepped down, or its lease lapsed).

Safety: a leader considers itself valid only until ``last successful refresh + ttl/2``; the
service refuses every request (NotLeader) past that instant, whatever its threads are doing. etcd
expires the lease no earlier than ``last refresh + ttl``, so a partitioned leader stops serving
at least ``ttl/2`` before anyone else can be elected: two leaders never accept requests at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from kvconnect.errors import CoordinationUnavailable
from kvconnect.etcd import Etcd
from kvconnect.store.rpc import LEADER_KEY

log = logging.getLogger(__name__)


class Leadership:
    """Campaigns for leadership; ``on_change(term)`` is called with the new term (0: not leader).

    ``valid_until`` (monotonic seconds) is the instant until which this master may act as
    leader; read it on every request.
    """

    def __init__(self, url: str, endpoint: str, ttl: int, on_change: Callable[[int], None]) -> None:
        self._url = url
        self._endpoint = endpoint
        self._ttl = ttl
        self._on_change = on_change
        self._etcd: Etcd | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lease = 0
        self.term = 0
        self.valid_until = 0.0

    def start(self) -> None:
        """Connect to etcd and start campaigning."""
        self._etcd = Etcd(self._url, timeout=self._ttl / 4)
        self._thread = threading.Thread(target=self._run, name="kvconnect-master-ha", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop; a leader gives its lease back so a standby takes over at once. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._ttl + 2)
            self._thread = None
        if self._etcd is not None:
            if self.term:
                self._demote("shutting down")
                self._quietly_revoke(self._lease)
            self._etcd.close()
            self._etcd = None

    def leading(self) -> bool:
        """Whether this master may act as leader right now."""
        return self.term > 0 and time.monotonic() < self.valid_until

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.term:
                self._renew()
                self._stop.wait(self._ttl / 4)
            else:
                self._campaign()
                if not self.term:
                    self._stop.wait(self._ttl / 8)

    def _campaign(self) -> None:
        assert self._etcd is not None
        try:
            value, _term = self._etcd.get(LEADER_KEY)
            if value is not None:
                return
            lease = self._etcd.grant(self._ttl)
            start = time.monotonic()
            term = self._etcd.create(LEADER_KEY, self._endpoint.encode(), lease)
        except CoordinationUnavailable as exc:
            log.debug("campaign failed: %s", exc)
            return
        if term is None:
            self._quietly_revoke(lease)
            return
        self._lease = lease
        self.valid_until = start + self._ttl / 2
        self.term = term
        log.warning("master %s is the leader (term %d)", self._endpoint, term)
        self._on_change(term)

    def _renew(self) -> None:
        assert self._etcd is not None
        start = time.monotonic()
        try:
            remaining = self._etcd.refresh(self._lease)
        except CoordinationUnavailable as exc:
            if time.monotonic() >= self.valid_until:
                self._demote(f"cannot renew the lease: {exc}")
            return
        if remaining <= 0:
            self._demote("the lease expired")
            return
        self.valid_until = start + self._ttl / 2

    def _demote(self, reason: str) -> None:
        if not self.term:
            return
        log.warning("master %s steps down (term %d): %s", self._endpoint, self.term, reason)
        self.term = 0
        self.valid_until = 0.0
        self._on_change(0)

    def _quietly_revoke(self, lease: int) -> None:
        assert self._etcd is not None
        with contextlib.suppress(CoordinationUnavailable):  # it lapses by itself anyway
            self._etcd.revoke(lease)
