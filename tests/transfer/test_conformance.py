"""The conformance suite over every transport and both data paths, peers in other processes
(the same-process transport, by definition, with a peer engine in this process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvconnect.testing.conformance import TARGET_BYTES, EngineTarget, Target
from kvconnect.testing.peer import PeerProcess
from kvconnect.transfer import MemoryRegion, TransferConfig, TransferEngine
from tests.support.conformance import CHECKS, ProcessTarget
from tests.support.hardware import DATAPATHS, native_mode

TRANSPORTS = ["tcp", "shm", "local"]


@pytest.fixture(
    scope="module",
    params=[(t, d) for t in TRANSPORTS for d in DATAPATHS],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[TransferEngine, MemoryRegion, Target]]:
    transport, datapath = request.param
    config = TransferConfig(transport=transport, native=native_mode(datapath))  # type: ignore[arg-type]
    with TransferEngine(config) as engine:
        local = engine.register(np.zeros(TARGET_BYTES, dtype=np.uint8))
        if transport == "local":
            with TransferEngine(config) as other:
                yield engine, local, EngineTarget(other)
        else:
            peer_config = {"transport": transport, "native": config.native}
            with PeerProcess(config=peer_config, shared=TARGET_BYTES, seed=1) as peer:
                yield engine, local, ProcessTarget(peer)
                assert engine.stats().transports[transport].bytes_read > 0


@pytest.mark.integration
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance(
    setup: tuple[TransferEngine, MemoryRegion, Target],
    check: Callable[[TransferEngine, MemoryRegion, Target, int], None],
) -> None:
    engine, local, target = setup
    check(engine, local, target, 42)


@pytest.mark.integration
@pytest.mark.parametrize("datapath", DATAPATHS)
def test_auto_picks_shm_for_shared_and_tcp_for_private_regions(datapath: str) -> None:
    config = TransferConfig(native=native_mode(datapath))  # type: ignore[arg-type]
    with (
        TransferEngine(config) as engine,
        PeerProcess(
            config={"native": config.native}, shared=1 << 20, private=1 << 20, seed=3
        ) as peer,
    ):
        local = engine.register(np.zeros(1 << 20, dtype=np.uint8))
        engine.read(local, 0, peer.name, peer.regions["shared"], 0, 1 << 20)
        engine.read(local, 0, peer.name, peer.regions["private"], 0, 1 << 20)
        stats = engine.stats().transports
        assert stats["shm"].bytes_read == 1 << 20
        assert stats["tcp"].bytes_read == 1 << 20
        assert stats["local"].bytes_read == 0
