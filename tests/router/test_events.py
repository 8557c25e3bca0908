"""EventSubscriber on real sockets: against the master's publisher (history, live stream, a
restart) and against a scripted publisher that skips batches and sends garbage. vLLM's own
publisher: tests/router/test_events_vllm.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import msgspec
import pytest
import zmq

from kvconnect.router.events import EventSubscriber
from kvconnect.store.kvevents import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    KVEventBatch,
    encode_batch,
    encode_seq,
    replay_answer,
)
from kvconnect.store.launch import free_port
from kvconnect.store.master.kvevents import KvEventPublisher
from tests.support.waiting import wait_for


def _tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def _batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockRemoved([i], "GPU")])


class Received:
    """What a subscriber delivered: the first hash of each batch, and the resets."""

    def __init__(self) -> None:
        self.hashes: list[int | bytes] = []
        self.resets = 0
        self._lock = threading.Lock()

    def on_batch(self, name: str, batch: KVEventBatch) -> None:
        assert name == "inst"
        with self._lock:
            for event in batch.events:
                if isinstance(event, BlockRemoved):
                    self.hashes.append(event.block_hashes[0])

    def on_reset(self, name: str) -> None:
        self.resets += 1

    def wait(self, count: int) -> list[int | bytes]:
        wait_for(lambda: len(self.hashes) >= count, f"{count} batches delivered")
        with self._lock:
            return list(self.hashes)


def _until(condition: Callable[[], bool], seconds: float) -> bool:
    """Whether ``condition`` became true within ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Publishing(Protocol):
    def publish(self, events: list[BlockRemoved]) -> None: ...


def _publish_until_seen(pub: Publishing, got: Received, first: int, count: int) -> int:
    """Publish batches ``first``, ``first + 1``, … until the subscriber delivered ``count``
    batches in all and the last one published (a PUB drops what it sends before the
    subscriber's connection is up: publishing again is how a test learns it is). Returns the
    next number."""
    n = first
    deadline = time.monotonic() + 20
    while True:
        pub.publish([BlockRemoved([n], "CPU")])
        n += 1
        if _until(lambda last=n - 1: len(got.hashes) >= count and got.hashes[-1] == last, 0.3):
            return n
        assert time.monotonic() < deadline, "the subscriber never received the live stream"


def test_history_live_stream_and_a_restart_of_the_master_publisher() -> None:
    pub_at, replay_at = _tcp(), _tcp()
    got = Received()
    first = KvEventPublisher(pub_at, replay_at, 100)
    first.start()
    for i in range(3):
        first.publish([BlockRemoved([i], "CPU")])
    wait_for(lambda: first.stats.published == 3, "published")
    sub = EventSubscriber(
        "inst", pub_at, replay_at, got.on_batch, timeout=0.2, on_reset=got.on_reset
    )
    with sub:
        assert got.wait(3) == [0, 1, 2], "a quiet publisher's history is replayed"
        i = _publish_until_seen(first, got, 3, 5)
        first.close()
        second = KvEventPublisher(pub_at, replay_at, 100)
        second.start()
        try:
            j = _publish_until_seen(second, got, 100, i + 1)
        finally:
            second.close()
    assert got.resets == 1
    assert got.hashes == [*range(i), *range(100, j)], "in order, once each"
    assert sub.stats.restarts == 1
    assert sub.stats.decode_errors == 0


def test_a_restart_whose_numbers_look_like_a_gap_is_a_restart() -> None:
    """A restarted publisher that sent more batches than the old one before the subscriber
    reconnected (lost to its SUB) numbers its next one past the expected: the dropped
    connection, not the number, says it restarted, and its history is replayed from 0."""
    pub_at, replay_at = _tcp(), _tcp()
    got = Received()
    first = KvEventPublisher(pub_at, replay_at, 100)
    first.start()
    sub = EventSubscriber(
        "inst", pub_at, replay_at, got.on_batch, timeout=0.2, on_reset=got.on_reset
    )
    with sub:
        i = _publish_until_seen(first, got, 0, 1)
        first.close()
        second = KvEventPublisher(pub_at, replay_at, 100)
        second.start()
        try:
            for n in range(i + 5):  # at once: before the subscriber's reconnect
                second.publish([BlockRemoved([1000 + n], "CPU")])
            wait_for(lambda: second.stats.published == i + 5, "published")
            j = _publish_until_seen(second, got, 1000 + i + 5, i + 1)
        finally:
            second.close()
    assert got.resets == 1
    assert got.hashes == [*range(i), *range(1000, j)], "the new history, in order, once each"
    assert sub.stats.restarts == 1


class Scripted:
    """A publisher the test drives frame by frame: an XPUB (so the test knows when the
    subscriber subscribed) and a ROUTER answering replays from ``ring`` on its own thread."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.endpoint, self.replay = _tcp(), _tcp()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(self.endpoint)
        self.ring: dict[int, bytes] = {}
        self.replays: list[int] = []
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(self.replay)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve)
        self._thread.start()

    def subscribed(self) -> None:
        self.pub.setsockopt(zmq.RCVTIMEO, 10_000)
        assert self.pub.recv()[:1] == b"\x01"

    def send(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        self.ring[seq] = payload
        if live:
            self.pub.send_multipart([b"", encode_seq(seq), payload])

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            identity, _empty, start = self._router.recv_multipart()
            self.replays.append(int.from_bytes(start, "big"))
            self._router.send_multipart([identity, b"", b"garbage"])
            for seq in sorted(self.ring):
                if seq >= int.from_bytes(start, "big"):
                    self._router.send_multipart(
                        [identity, *replay_answer(b"", seq, self.ring[seq])]
                    )
            self._router.send_multipart([identity, *replay_answer(b"", END_SEQ, b"")])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._router.close()
        self.pub.close()


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    publisher = Scripted(ctx)
    yield publisher
    publisher.close()
    ctx.term()


def test_a_gap_is_replayed_and_garbage_is_skipped(scripted: Scripted) -> None:
    got = Received()
    with EventSubscriber(
        "inst", scripted.endpoint, scripted.replay, got.on_batch, timeout=5
    ) as sub:
        scripted.subscribed()
        scripted.send(0, encode_batch(_batch(0)))
        assert got.wait(1) == [0]
        scripted.send(1, encode_batch(_batch(1)), live=False)  # dropped on the way
        scripted.send(2, encode_batch(_batch(2)), live=False)
        for garbage in (
            [b"only one frame"],
            [b"", b"short", b"x"],
            [b"", encode_seq(END_SEQ), b"x"],
            [b"", encode_seq(9), b"x", b"four frames"],
        ):
            scripted.pub.send_multipart(garbage)
        scripted.send(3, encode_batch(_batch(3)))
        assert got.wait(4) == [0, 1, 2, 3]
        assert scripted.replays[-1] == 1, "the replay asks from the first missing batch"
        scripted.send(4, b"\xc1 not msgpack")
        bad_events = msgspec.msgpack.encode([5.0, [{"type": "Nope"}, {"type": "AllBlocksCleared"}]])
        scripted.send(5, bad_events)
        scripted.send(6, encode_batch(_batch(6)))
        assert got.wait(5) == [0, 1, 2, 3, 6]
        stats = sub.stats  # counted before each batch is handed over
    assert stats.batches == 6
    assert (stats.gaps, stats.replayed, stats.lost) == (1, 2, 0)
    assert stats.decode_errors == 4 + 1 + 1, "4 garbage frames, 1 in the replay, 1 payload"
    assert stats.skipped_events == 1
    assert scripted.replays.count(1) == 1


def test_without_a_replay_endpoint_a_gap_is_lost(scripted: Scripted) -> None:
    got = Received()
    with EventSubscriber("inst", scripted.endpoint, None, got.on_batch, timeout=5) as sub:
        scripted.subscribed()
        scripted.send(0, encode_batch(_batch(0)))
        scripted.send(3, encode_batch(_batch(3)))
        assert got.wait(2) == [0, 3]
        assert (sub.stats.gaps, sub.stats.lost) == (1, 2)
    assert scripted.replays == []


def test_a_failing_callback_is_counted_and_the_stream_goes_on(scripted: Scripted) -> None:
    got = Received()

    def on_batch(name: str, batch: KVEventBatch) -> None:
        if any(isinstance(e, AllBlocksCleared) for e in batch.events):
            raise RuntimeError("a broken index")
        got.on_batch(name, batch)

    with EventSubscriber("inst", scripted.endpoint, scripted.replay, on_batch, timeout=5) as sub:
        scripted.subscribed()
        scripted.send(0, encode_batch(KVEventBatch(0.0, [AllBlocksCleared()])))
        scripted.send(1, encode_batch(_batch(1)))
        assert got.wait(1) == [1]
        assert sub.stats.callback_errors == 1
