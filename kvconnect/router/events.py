"""Following one publisher's KV events: a vLLM instance's (``--kv-events-config``) or the
store master's (``--master-kv-events``), in the wire format of :mod:`kvconnect.store.kvevents`.

:class:`EventSubscriber` runs its own thread: a SUB socket on the publisher's endpoint and,
when the publisher has a replay endpoint, a DEALER on it for what the stream missed. Batches
are numbered per publisher process; the subscriber expects them in order from 0, so

- the first batch it sees, if later than 0, starts with a replay of the earlier ones (and a
  publisher quiet since the subscriber started is asked for its buffered history, until it
  answers);
- a batch past the next expected one (a dropped message, a reconnect) is a gap: the missed
  batches are replayed before it is delivered; what the publisher no longer buffers is lost;
- a batch before the next expected one is a restarted publisher (a new process counts from
  0 again): ``on_reset`` is called, then the new process's history is replayed;
- so is a dropped connection to the publisher, once it is back: a restarted publisher may send its
  first batches before the subscriber reconnected (they are lost to a SUB) and then go quiet,
  or send more of them than the old one did, so that its numbers look like a gap; neither
  shows in the numbers. The subscriber then starts over from 0, as at its start. A publisher
  that only lost its connection is taken for a restarted one too: its buffered history
  rebuilds what the subscriber knows, and what it no longer buffers is missed, never stale.

Frames and payloads that are not batches are counted and skipped; nothing a publisher sends
stops the thread. Every wait has a timeout, and :meth:`EventSubscriber.close` interrupts any
(unless a callback is running).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from kvconnect.lifecycle import Lifecycle
from kvconnect.store.kvevents import (
    END_SEQ,
    KVEventBatch,
    decode_batch,
    parse_published,
    parse_replay,
    replay_request,
)

log = logging.getLogger(__name__)

MAX_REPLAY = 1_000_000
"""Answers one replay reads at most (vLLM buffers 10,000 batches by default)."""

_TICK = 0.05  # seconds between looks at close() during a wait

OnBatch = Callable[[str, KVEventBatch], None]
OnReset = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    """Counters of one subscriber since it started."""

    batches: int = 0
    """Batches delivered (live and replayed)."""
    replayed: int = 0
    """Of which from a replay."""
    gaps: int = 0
    """Gaps found in the live stream (a late first batch included)."""
    lost: int = 0
    """Batches neither received nor replayed (the publisher had dropped them)."""
    restarts: int = 0
    """Times the publisher's sequence went back (a new publisher process)."""
    duplicates: int = 0
    """Live batches dropped as already replayed."""
    decode_errors: int = 0
    """Frames or payloads that were not batches."""
    skipped_events: int = 0
    """Events of unknown types (or malformed) left out of their batches."""
    callback_errors: int = 0
    """Batches whose ``on_batch`` raised (logged)."""


class EventSubscriber(Lifecycle):
    """Delivers one publisher's batches, in order, to ``on_batch(name, batch)``.

    ``endpoint``: the publisher's PUB endpoint (connected to); ``replay``: its ROUTER
    endpoint, or None (gaps are then only counted as lost); ``topic``: the topic prefix
    subscribed to; ``timeout``: seconds any one wait lasts (a replay answer, a poll).
    ``on_batch`` and ``on_reset(name)`` run on the subscriber's thread, one at a time; what
    they raise is logged and counted, never stops it. ``start()`` starts the thread,
    ``close()`` stops it (idempotent; it waits for a running callback, at most 5 s)."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        replay: str | None,
        on_batch: OnBatch,
        *,
        topic: str = "",
        timeout: float = 1.0,
        on_reset: OnReset | None = None,
    ) -> None:
        self.name = name
        self._endpoint = endpoint
        self._replay_endpoint = replay
        self._on_batch = on_batch
        self._on_reset = on_reset
        self._topic = topic.encode()
        self._timeout = timeout
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._dealer: zmq.Socket[bytes] | None = None
        self._next = 0  # the sequence number expected next
        self._caught_up = False  # a batch arrived, or a replay of the history was answered
        self._just_replayed = False  # live batches below _next are duplicates, not a restart
        self._dropped = False  # the publisher's connection dropped: start over when it is back
        self._lock = threading.Lock()
        self._stats = SubscriberStats()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def stats(self) -> SubscriberStats:
        """A snapshot of the counters (any thread)."""
        with self._lock:
            return self._stats

    def start(self) -> None:
        """Start the thread (connects asynchronously: a publisher not up yet is awaited)."""
        if self._thread is not None:
            return
        self._ctx = zmq.Context()
        self._thread = threading.Thread(
            target=self._run, args=(self._ctx,), name=f"kvconnect-events-{self.name}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close the sockets. Idempotent."""
        self._closing.set()
        if self._thread is None:
            return
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():  # stuck in on_batch: its sockets stay open
            log.warning("KV events of %s: subscriber thread did not stop", self.name)
        elif self._ctx is not None:
            self._ctx.term()
        self._thread = None

    # ------------------------------------------------------------------------------ thread

    def _run(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self._endpoint)
        try:
            while not self._closing.is_set():
                self._dropped = self._dropped or _disconnected(monitor)
                if self._wait(sub):
                    self._live(sub.recv_multipart(zmq.NOBLOCK))
                    continue
                self._just_replayed = False  # duplicates would have arrived by now
                if self._dropped and self._replay_endpoint is not None:
                    self._dropped = False  # a quiet publisher since: start over now
                    self._restarted("its connection dropped")
                if not self._caught_up and self._replay_endpoint is not None:
                    self._replay(None)  # a quiet publisher's history
        except Exception:  # the thread must not die silently; a zmq error ends it
            log.exception("KV events of %s: subscriber stopped", self.name)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            self._drop_dealer()

    def _wait(self, sock: zmq.Socket[bytes]) -> bool:
        """Whether ``sock`` has a message within ``timeout`` (False at once when closing)."""
        deadline = time.monotonic() + self._timeout
        while not self._closing.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if sock.poll(max(1, int(min(left, _TICK) * 1000))):
                return True
        return False

    def _live(self, frames: list[bytes]) -> None:
        parsed = parse_published(frames)
        if parsed is None:
            self._count(decode_errors=1)
            return
        seq, payload = parsed
        if seq < self._next and self._just_replayed:
            self._count(duplicates=1)
            return
        self._just_replayed = False
        if seq < self._next or self._dropped:
            self._restarted(
                f"seq {seq} after a dropped connection" if self._dropped else f"seq {seq}"
            )
            self._dropped = False
        if seq > self._next:
            self._count(gaps=1)
            self._replay(seq)
            if seq > self._next:
                self._count(lost=seq - self._next)
        self._deliver(seq, payload, replayed=False)

    def _replay(self, target: int | None) -> None:
        """Deliver the buffered batches from ``_next`` up to ``target`` (excluded; None: all
        of them). Reads the whole answer, so the next replay starts clean; a publisher that
        stops answering loses this DEALER (a late answer must not reach the next replay)."""
        if self._replay_endpoint is None:
            return
        dealer = self._dealer_socket()
        try:
            dealer.send_multipart(replay_request(self._next), flags=zmq.NOBLOCK)
        except zmq.Again:
            self._drop_dealer()
            return
        for _ in range(MAX_REPLAY):
            if not self._wait(dealer):
                log.debug("KV events of %s: replay unanswered", self.name)
                self._drop_dealer()
                return
            answer = parse_replay(dealer.recv_multipart(zmq.NOBLOCK))
            if answer is None:
                self._count(decode_errors=1)
                continue
            seq, payload = answer
            if seq == END_SEQ:
                self._caught_up = True
                break
            if seq >= self._next and (target is None or seq < target):
                if seq > self._next:
                    self._count(lost=seq - self._next)  # no longer buffered
                self._deliver(seq, payload, replayed=True)
        self._just_replayed = target is None

    def _deliver(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        self._next = seq + 1
        self._caught_up = True
        try:
            decoded = decode_batch(payload)
        except msgspec.DecodeError:
            self._count(decode_errors=1)
            return
        self._count(batches=1, replayed=int(replayed), skipped_events=decoded.skipped)
        try:
            self._on_batch(self.name, decoded.batch)
        except Exception:
            log.exception("KV events of %s: on_batch failed", self.name)
            self._count(callback_errors=1)

    def _restarted(self, why: str) -> None:
        """Start over from 0, as at the start: the publisher restarted (or may have)."""
        log.info("KV events of %s: publisher restarted (%s)", self.name, why)
        self._count(restarts=1)
        self._next = 0
        self._caught_up = False
        self._reset()

    def _reset(self) -> None:
        if self._on_reset is None:
            return
        try:
            self._on_reset(self.name)
        except Exception:
            log.exception("KV events of %s: on_reset failed", self.name)
            self._count(callback_errors=1)

    def _dealer_socket(self) -> zmq.Socket[bytes]:
        if self._dealer is None:
            assert self._replay_endpoint is not None
            assert self._ctx is not None
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self._replay_endpoint)
        return self._dealer

    def _drop_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def _count(self, **deltas: int) -> None:
        with self._lock:
            stats = self._stats
            self._stats = dataclasses.replace(
                stats, **{name: getattr(stats, name) + delta for name, delta in deltas.items()}
            )


def _disconnected(monitor: zmq.Socket[bytes]) -> bool:
    """Whether ``monitor`` (a SUB socket's) reported a dropped connection since last asked."""
    dropped = False
    while monitor.poll(0):
        monitor.recv_multipart(zmq.NOBLOCK)  # only EVENT_DISCONNECTED is monitored
        dropped = True
    return dropped
