"""The metadata backends without etcd (embedded, p2p) and the engine's SegmentDirectory cache."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvconnect.errors import ConfigError, PeerUnreachable, SegmentNotFound
from kvconnect.transfer import (
    EmbeddedMetadata,
    P2PMetadata,
    SegmentDescriptor,
    SegmentRegistry,
    TransferEngine,
)
from kvconnect.transfer.metadata.directory import SegmentDirectory


def _descriptor(name: str, engine_id: str) -> SegmentDescriptor:
    return SegmentDescriptor(
        name=name, engine_id=engine_id, process_id="p", host_id="h", endpoints={"tcp": "x:1"}
    )


class _Backend:
    """A backend whose lookups block until ``release`` is set, counting calls."""

    def __init__(self, answers: list[SegmentDescriptor | Exception]) -> None:
        self.answers = answers
        self.calls = 0
        self.release = threading.Event()
        self.entered = threading.Event()

    def start(self, on_change: Callable[[str], None]) -> None:
        """Nothing to watch."""

    def publish(self, descriptor: SegmentDescriptor) -> None:
        """Not used."""

    def withdraw(self, name: str) -> None:
        """Not used."""

    def lookup(self, name: str, timeout: float) -> SegmentDescriptor:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(10)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def close(self) -> None:
        """Nothing held."""


def test_concurrent_lookups_of_one_name_share_one_backend_call() -> None:
    backend = _Backend([_descriptor("a", "e1")])
    directory = SegmentDirectory(backend, 5.0, lambda _old: None)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(directory.resolve, "a")
        assert backend.entered.wait(10)
        others = [pool.submit(directory.resolve, "a") for _ in range(3)]
        backend.release.set()
        results = [first.result(10), *(f.result(10) for f in others)]
    assert backend.calls == 1
    assert {r.engine_id for r in results} == {"e1"}
    assert directory.cached("a") is results[0]


def test_a_failed_lookup_reaches_every_waiter_and_is_not_cached() -> None:
    backend = _Backend([PeerUnreachable("down"), _descriptor("a", "e1")])
    directory = SegmentDirectory(backend, 5.0, lambda _old: None)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(directory.resolve, "a")
        assert backend.entered.wait(10)
        second = pool.submit(directory.resolve, "a")
        backend.release.set()
        for future in (first, second):
            with pytest.raises(PeerUnreachable):
                future.result(10)
    assert directory.cached("a") is None
    assert directory.resolve("a").engine_id == "e1"
    assert backend.calls == 2


def test_a_name_served_by_another_engine_reports_the_old_one_once() -> None:
    backend = _Backend([_descriptor("a", "e1"), _descriptor("a", "e1"), _descriptor("a", "e2")])
    backend.release.set()
    replaced: list[SegmentDescriptor] = []
    directory = SegmentDirectory(backend, 5.0, replaced.append)
    old = directory.resolve("a")
    directory.forget("a")
    assert directory.resolve("a").engine_id == "e1"
    assert replaced == [], "the same engine published again: nothing to forget"
    directory.forget("a")
    assert directory.resolve("a").engine_id == "e2"
    assert replaced == [old]


def test_embedded_publish_lookup_withdraw_and_changes() -> None:
    registry = SegmentRegistry()
    changes: list[str] = []
    mine, other = EmbeddedMetadata(registry), EmbeddedMetadata(registry)
    mine.start(changes.append)
    try:
        descriptor = _descriptor("seg", "e1")
        mine.publish(descriptor)
        assert other.lookup("seg", 1.0) == descriptor
        with pytest.raises(ConfigError, match="already used by another engine"):
            other.publish(_descriptor("seg", "e2"))
        other.withdraw("seg")  # not its segment: nothing happens
        assert mine.lookup("seg", 1.0) == descriptor
        mine.withdraw("seg")
        with pytest.raises(SegmentNotFound):
            other.lookup("seg", 1.0)
        assert changes == ["seg", "seg"]
    finally:
        mine.close()
        other.close()


def test_p2p_lookup_asks_the_listener_for_its_live_descriptor() -> None:
    with TransferEngine() as engine:
        metadata = P2PMetadata(engine.config.token)
        assert metadata.lookup(engine.name, 5.0) == engine.segment
        region = engine.register(np.zeros(4096, dtype=np.uint8))
        found = metadata.lookup(engine.name, 5.0)
        assert found.region(region.id) is not None, "a new region is visible at once"
        assert found.engine_id == engine.segment.engine_id
    with pytest.raises(PeerUnreachable):
        metadata.lookup(engine.name, 1.0)
