"""The plug-in point: a transport registered from outside the package is built, routed to,
reported in stats, passes the conformance suite and is told to forget restarted peers."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import numpy as np
import pytest

from kvconnect.errors import TransferError
from kvconnect.testing import conformance
from kvconnect.testing.conformance import TARGET_BYTES, EngineTarget
from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import (
    Capabilities,
    MemoryRegion,
    P2PMetadata,
    SegmentDescriptor,
    TransferEngine,
    TransferOp,
    TransportStats,
)
from kvconnect.transfer.batch import Slice
from kvconnect.transfer.transports import registry
from kvconnect.transfer.transports.base import TransportContext, TransportEntry
from kvconnect.transfer.transports.local import LocalTransport

MiB = 1 << 20
Check = Callable[[TransferEngine, MemoryRegion, conformance.Target, int], None]


class CountingTransport:
    """A third-party transport in a dozen lines: memcpy to engines of this process (through the
    built-in one), counting what it is asked to do."""

    name = "counting"
    capabilities = Capabilities(same_host_only=True, same_process_only=True)
    built: ClassVar[list[CountingTransport]] = []

    def __init__(self, context: TransportContext) -> None:
        self._inner = LocalTransport(context.copier, context.workers)
        self.slices = 0
        self.forgotten: list[str] = []
        CountingTransport.built.append(self)

    def submit(self, peer: SegmentDescriptor, op: TransferOp, slices: Sequence[Slice]) -> None:
        self.slices += len(slices)
        self._inner.submit(peer, op, slices)

    def forget(self, engine_id: str) -> None:
        self.forgotten.append(engine_id)

    def stats(self) -> TransportStats:
        return self._inner.stats()

    def close(self) -> None:
        self._inner.close()


@pytest.fixture
def counting() -> Iterator[list[CountingTransport]]:
    """Register the counting transport, preferred over every built-in one, for one test."""
    CountingTransport.built.clear()
    registry.register(TransportEntry(CountingTransport.name, CountingTransport), before="local")
    try:
        yield CountingTransport.built
    finally:
        registry.unregister(CountingTransport.name)
    assert CountingTransport.name not in [e.name for e in registry.entries()]


def test_registering_twice_or_before_an_unknown_transport_is_refused(
    counting: list[CountingTransport],
) -> None:
    entry = TransportEntry(CountingTransport.name, CountingTransport)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(entry, before="tcp")
    with pytest.raises(ValueError, match="no transport 'nope'"):
        registry.register(TransportEntry("other", CountingTransport), before="nope")


@pytest.mark.parametrize(
    "check",
    [
        conformance.check_sizes,
        conformance.check_many_small,
        conformance.check_concurrent,
        conformance.check_refusals,
    ],
    ids=lambda c: c.__name__,
)
def test_a_registered_transport_passes_the_conformance_suite(
    counting: list[CountingTransport], check: Check
) -> None:
    with TransferEngine() as engine, TransferEngine() as other:
        local = engine.register(np.zeros(TARGET_BYTES, dtype=np.uint8))
        check(engine, local, EngineTarget(other), 42)
        stats = engine.stats().transports
        moved = stats["counting"].bytes_read + stats["counting"].bytes_written
        refusals_only = check is conformance.check_refusals  # refused before any transport
        assert (counting[0].slices > 0) == (moved > 0) == (not refusals_only)
        assert stats["local"] == TransportStats(), "auto must prefer the registered transport"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _read_until_served(
    engine: TransferEngine, local: MemoryRegion, peer: PeerProcess, region: str
) -> None:
    """Read 1 MiB of ``region``: the first attempts after a restart may fail (the engine still
    knows the old peer, and finds out by failing); a retry looks the segment up afresh."""
    deadline = time.monotonic() + 30
    while True:
        try:
            engine.read(local, 0, peer.name, peer.regions[region], 0, MiB, timeout=5)
            return
        except TransferError:
            if time.monotonic() > deadline:
                raise


@pytest.mark.integration
def test_a_peer_restarted_on_its_segment_name_is_forgotten_by_every_transport(
    counting: list[CountingTransport],
) -> None:
    port = _free_port()
    config = {"listen_port": port}
    with TransferEngine() as engine:
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        (mine,) = counting
        with PeerProcess(config=config, shared=MiB, private=MiB, seed=1) as first:
            for region in ("shared", "private"):
                engine.read(local, 0, first.name, first.regions[region], 0, MiB)
            stats = engine.stats().transports
            assert (stats["shm"].peers, stats["tcp"].peers) == (1, 1)
            old = P2PMetadata(engine.config.token).lookup(first.name, 5).engine_id
            first.kill()
        with PeerProcess(config=config, shared=MiB, private=MiB, seed=2) as second:
            assert second.name == first.name
            new = P2PMetadata(engine.config.token).lookup(second.name, 5).engine_id
            assert new != old
            for region, seed in (("shared", 2), ("private", 3)):
                _read_until_served(engine, local, second, region)
                assert local.view == pattern(seed, MiB).data, region
            assert mine.forgotten == [old]
            stats = engine.stats().transports
            assert (stats["shm"].peers, stats["tcp"].peers) == (1, 1), "the old peer is gone"
