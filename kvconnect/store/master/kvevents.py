"""The master's KV events (opt-in, ``MasterConfig.kv_events``): what the store holds, in
vLLM's event format (:mod:`kvconnect.store.kvevents`), for external indexers and the router.

The store is one tier to an indexer: an object is announced (``BlockStored``) when it becomes
readable — its put completed, or a store server reported it after a master restart — and
withdrawn (``BlockRemoved``) when it stops existing in every tier (removed by a client,
evicted, expired with its server, lost). Moves between DRAM and disk announce nothing.
Every event carries ``medium="CPU"``, ``locality="REMOTE"``, ``ownership="kvconnect"``, as the
vLLM connector's pool events do. A key of kvconnect's vLLM pool scheme
(``…/vllm/<model>/<compat>/<hex block hash>/g<group>``) is published as that block hash
(bytes) and ``group_idx``; any other key (SGLang's, an application's) as its UTF-8 bytes. A
``BlockStored`` knows no tokens (``token_ids=[]``, no parent, ``block_size=0``).

Tenants' objects are never published: the stream has one audience (whoever can reach the
endpoint), and a tenant's keys are its own (docs/store.md, "Tenants"); a tenant's vLLM instances
publish their pool's blocks through vLLM's own publisher, as every instance does.

A master publishes ``AllBlocksCleared`` first, and again whenever a new HA term starts from an
empty index. The service thread hands batches to :class:`KvEventPublisher` without blocking
(a full queue drops the batch and counts it); its own thread sends them and answers replays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import zmq

from kvconnect.lifecycle import Lifecycle
from kvconnect.store import messages as m
from kvconnect.store.kvevents import (
    END_SEQ,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    OWNERSHIP_KVCONNECT,
    SEQ_BYTES,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
    encode_seq,
    replay_answer,
)
from kvconnect.store.master import tenants
from kvconnect.store.master.removals import MAX_REMOVALS
from kvconnect.store.master.state import MasterState

log = logging.getLogger(__name__)

QUEUE = 4096
"""Batches waiting for the publisher thread at most (then new ones are dropped)."""
_REPLAYS_PER_BATCH = 8  # replay requests answered between two batches at most
_IDLE = 0.05  # seconds the thread waits for a batch before looking at replay requests
_MAX_REQUEST = 64  # bytes a replay request may have (a bigger one disconnects its peer)

_POOL_KEY = re.compile(r"(?:^|/)vllm/[^/]+/[^/]+/((?:[0-9a-f]{2})+)/g([0-9]{1,9})$")


def key_hash(key: str) -> tuple[bytes, int] | None:
    """``(block hash, group)`` of a key of kvconnect's vLLM pool scheme
    (``kvconnect.vllm.pool.PoolKeys.block_key``: the hash as lower-case hex), or None."""
    match = _POOL_KEY.search(key)
    if match is None:
        return None
    return bytes.fromhex(match.group(1)), int(match.group(2))


def _block(key: str) -> tuple[BlockHash, int | None]:
    parsed = key_hash(key)
    return parsed if parsed is not None else (key.encode(), None)


def stored_event(key: str) -> BlockStored:
    """The announcement of a readable object."""
    block_hash, group = _block(key)
    return BlockStored(
        block_hashes=[block_hash],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=MEDIUM_CPU,
        lora_name=None,
        group_idx=group,
        locality=LOCALITY_REMOTE,
        ownership=OWNERSHIP_KVCONNECT,
    )


def removed_events(keys: Iterable[str]) -> list[BlockRemoved]:
    """The withdrawal of objects gone: one event per group (in the order groups appear)."""
    groups: dict[int | None, list[BlockHash]] = {}
    for key in keys:
        block_hash, group = _block(key)
        groups.setdefault(group, []).append(block_hash)
    return [
        BlockRemoved(
            block_hashes=hashes,
            medium=MEDIUM_CPU,
            group_idx=group,
            locality=LOCALITY_REMOTE,
            ownership=OWNERSHIP_KVCONNECT,
        )
        for group, hashes in groups.items()
    ]


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """Counters of a publisher since it started."""

    published: int = 0
    dropped: int = 0
    """Batches dropped because the queue was full."""
    replays: int = 0
    """Replay requests answered."""
    bad_requests: int = 0
    """Replay requests ignored (not ``[b"", 8-byte seq]``)."""


class KvEventPublisher(Lifecycle):
    """A PUB socket bound at ``endpoint`` (and a ROUTER at ``replay`` answering replays from
    the last ``buffer`` batches). :meth:`publish` never blocks; ``start()`` binds (raising
    zmq.ZMQError when it cannot) and starts the thread; ``close()`` stops it, sending what
    was queued first (within about a second)."""

    def __init__(
        self, endpoint: str, replay: str | None, buffer: int, *, topic: str = "", size: int = QUEUE
    ) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay
        self._topic = topic.encode()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=size)
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._seq = 0
        self._stats = PublisherStats()
        self._dropped = 0  # counted by the publishing thread, the rest by the publisher's

    @property
    def endpoint(self) -> str:
        """The bound PUB endpoint (after ``start()``; a port 0 resolved)."""
        return self._bound(self._pub, self._endpoint)

    @property
    def replay_endpoint(self) -> str | None:
        """The bound replay endpoint, or None."""
        if self._replay_endpoint is None:
            return None
        return self._bound(self._router, self._replay_endpoint)

    @property
    def stats(self) -> PublisherStats:
        return dataclasses.replace(self._stats, dropped=self._dropped)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(self._endpoint)
            if self._replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST)
                # room for a whole replay and its end marker for a slow reader (zmq counts
                # its reads late, by half the high-water mark)
                self._router.setsockopt(zmq.SNDHWM, 2 * (self._ring.maxlen or 0) + 2)
                self._router.bind(self._replay_endpoint)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            self._ctx = None
            raise
        # The sockets move to the thread (its start is the memory barrier zmq asks for).
        self._thread = threading.Thread(target=self._run, name="kvconnect-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one batch (any thread; never blocks: a full queue drops it)."""
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), list(events)))
        except queue.Full:
            self._dropped += 1

    def close(self) -> None:
        """Idempotent."""
        if self._thread is None:
            return
        with contextlib.suppress(queue.Full):  # the thread is stuck or far behind: a daemon
            self._queue.put(None, timeout=1.0)
        self._thread.join(timeout=2.0)
        if self._thread.is_alive():
            log.warning("KV events: publisher thread did not stop")
        elif self._ctx is not None:
            self._ctx.term()
        self._thread = None

    # ------------------------------------------------------------------------------ thread

    def _run(self) -> None:
        assert self._pub is not None
        try:
            while True:
                self._serve_replays()
                try:
                    batch = self._queue.get(timeout=_IDLE)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                self._send(self._pub, batch)
        finally:
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)

    def _send(self, pub: zmq.Socket[bytes], batch: KVEventBatch) -> None:
        payload = encode_batch(batch)
        seq, self._seq = self._seq, self._seq + 1
        self._ring.append((seq, payload))
        try:
            pub.send_multipart([self._topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # PUB drops at its high-water mark; this is rarer
            log.warning("KV events: batch %d not sent: %s", seq, exc)
        self._count(published=1)

    def _serve_replays(self) -> None:
        router = self._router
        for _ in range(_REPLAYS_PER_BATCH):
            if router is None or not router.poll(0):
                return
            try:
                self._answer(router, router.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError as exc:
                log.warning("KV events: replay failed: %s", exc)

    def _answer(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """Answer ``[identity, b"", seq]`` with the buffered batches from seq on, then the
        end marker; anything else is ignored (a ROUTER never blocks on a slow peer: what it
        cannot queue for that peer is dropped)."""
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
            self._count(bad_requests=1)
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._ring):
            if seq >= start:
                router.send_multipart(
                    [identity, *replay_answer(self._topic, seq, payload)], flags=zmq.NOBLOCK
                )
        router.send_multipart([identity, *replay_answer(b"", END_SEQ, b"")], flags=zmq.NOBLOCK)
        self._count(replays=1)

    def _count(self, **deltas: int) -> None:
        stats = self._stats
        self._stats = dataclasses.replace(
            stats, **{name: getattr(stats, name) + delta for name, delta in deltas.items()}
        )

    @staticmethod
    def _bound(sock: zmq.Socket[bytes] | None, configured: str) -> str:
        if sock is None:
            return configured
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


@dataclass(frozen=True, slots=True)
class Watch:
    """Keys a request may make readable, and which of them were readable before it."""

    keys: list[str]
    before: list[bool]


def _readable_candidates(request: m.Request) -> list[str]:
    """The keys ``request`` may make readable, tenants' left out (never published)."""
    if isinstance(request, m.PutEnd):
        keys: Iterable[str] = request.keys  # a multi-part put names its key per part
    elif isinstance(request, m.Mount | m.Report):
        keys = (change.key for change in request.held if change.key)
    else:
        return []
    return [key for key in dict.fromkeys(keys) if not tenants.of_a_tenant(key)]


class MasterEvents(Lifecycle):
    """The master's side: what each request and tick changed, as batches for the publisher.

    Called by the service thread only: :meth:`watch` before a request is applied,
    :meth:`changed` after it (and after each tick), :meth:`new_state` when the service starts
    a new :class:`MasterState`. Removals come from the state's removal log (every complete
    object that stopped existing is there), so nothing inside the state machine knows about
    events."""

    def __init__(self, publisher: KvEventPublisher) -> None:
        self.publisher = publisher
        self._seen = 0  # the last removal-log entry published

    def start(self) -> None:
        self.publisher.start()
        log.info(
            "KV events on %s (replay: %s)",
            self.publisher.endpoint,
            self.publisher.replay_endpoint,
        )
        self.publisher.publish([AllBlocksCleared()])

    def close(self) -> None:
        self.publisher.close()

    def watch(self, state: MasterState, request: m.Request) -> Watch:
        keys = _readable_candidates(request)
        return Watch(keys, state.exists(keys) if keys else [])

    def changed(self, state: MasterState, watch: Watch | None = None) -> None:
        """Publish what became readable since ``watch`` and what the removal log gained."""
        events: list[KVEvent] = list(removed_events(self._removed(state)))
        if watch is not None and watch.keys:
            after = state.exists(watch.keys)
            for key, was, now in zip(watch.keys, watch.before, after, strict=True):
                if now and not was:
                    events.append(stored_event(key))
        if events:
            self.publisher.publish(events)

    def new_state(self) -> None:
        """The service replaced its state (a new term): nothing is stored any more."""
        self._seen = 0
        self.publisher.publish([AllBlocksCleared()])

    def _removed(self, state: MasterState) -> list[str]:
        keys: list[str] = []
        while True:
            reply = state.removals.since("", self._seen, MAX_REMOVALS)
            keys += [r.key for r in reply.removed if not tenants.of_a_tenant(r.key)]
            if reply.next == self._seen:
                return keys
            self._seen = reply.next
