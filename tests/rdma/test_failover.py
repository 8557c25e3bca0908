"""RDMA failures with real verbs: a peer dying mid-batch, the RDMA netdev going down mid-batch,
a region withdrawn under a cached key, and deadlines passing while work is posted."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvconnect.errors import AccessDenied, ConfigError, KVConnectError
from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import (
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    TransferStatus,
)

pytestmark = [pytest.mark.rdma, pytest.mark.integration]

MiB = 1 << 20
BLOCKS = 48  # 48 MiB: seconds under Soft-RoCE emulation, so the fault lands mid-batch


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    with TransferEngine(TransferConfig(transport="rdma")) as eng:
        yield eng


def _reads(local: object, peer: PeerProcess, count: int) -> list[TransferRequest]:
    region = peer.regions["shared"]
    return [
        TransferRequest(local, i * MiB, peer.name, region, i * MiB + 5, MiB)  # type: ignore[arg-type]
        for i in range(count)
    ]


def _rdma_netdev() -> str:
    """The netdev under the first RDMA device (rxe's veth in the VM)."""
    ports = next(Path("/sys/class/infiniband").iterdir()) / "ports" / "1" / "gid_attrs" / "ndevs"
    for entry in sorted(ports.iterdir()):
        try:
            name = entry.read_text().strip()
        except OSError:  # GID slots without a netdev cannot be read
            continue
        if name:
            return name
    raise AssertionError("no netdev found under the RDMA device")


def test_peer_death_mid_batch_fails_requests_before_their_deadline(
    engine: TransferEngine,
) -> None:
    local = engine.register(np.zeros(BLOCKS * MiB, dtype=np.uint8))
    with PeerProcess(config={"transport": "rdma"}, shared=BLOCKS * MiB + MiB, seed=5) as peer:
        engine.read(local, 0, peer.name, peer.regions["shared"], 0, MiB)  # links are up
        batch = engine.submit(TransferOp.READ, _reads(local, peer, BLOCKS), timeout=600)
        peer.kill()
        statuses = batch.wait()
    assert TransferStatus.PENDING not in statuses
    # The deadline is far away: every request that did not complete failed because the peer
    # died (retries exhausted, reconnect refused), none timed out.
    assert TransferStatus.TIMEOUT not in statuses
    failed = [i for i, s in enumerate(statuses) if s is TransferStatus.FAILED]
    assert failed, "the peer died before any request could fail: batch too small"
    assert all(isinstance(batch.errors[i], KVConnectError) for i in failed)
    expected = pattern(5, BLOCKS * MiB + MiB)
    for i, status in enumerate(statuses):
        if status is TransferStatus.COMPLETED:
            got = local.view[i * MiB : (i + 1) * MiB]
            assert got == expected[i * MiB + 5 : (i + 1) * MiB + 5].data


def test_withdrawn_region_is_refused_through_the_tcp_fallback(engine: TransferEngine) -> None:
    local = engine.register(np.zeros(MiB, dtype=np.uint8))
    with PeerProcess(config={"transport": "rdma"}, shared=MiB, seed=6) as peer:
        old = peer.regions["shared"]
        engine.read(local, 0, peer.name, old, 0, MiB)  # caches the region's rkey
        fresh = peer.fence("shared")  # the old MR is deregistered: its rkey is dead
        local.view[:] = b"\x33" * MiB
        batch = engine.submit(
            TransferOp.READ, [TransferRequest(local, 0, peer.name, old, 0, MiB)], timeout=60
        )
        assert batch.wait() == (TransferStatus.FAILED,)
        assert isinstance(batch.errors[0], AccessDenied), batch.errors
        assert local.view[:] == b"\x33" * MiB, "a refused READ changed local memory"
        engine.read(local, 0, peer.name, fresh, 0, MiB)
        assert local.view[:] == pattern(6, MiB).data


def test_deadline_mid_transfer_settles_before_wait_returns(engine: TransferEngine) -> None:
    local = engine.register(np.zeros(BLOCKS * MiB, dtype=np.uint8))
    with PeerProcess(config={"transport": "rdma"}, shared=BLOCKS * MiB + MiB, seed=7) as peer:
        engine.read(local, 0, peer.name, peer.regions["shared"], 0, MiB)
        local.view[:] = b"\0" * (BLOCKS * MiB)
        batch = engine.submit(TransferOp.READ, _reads(local, peer, BLOCKS), timeout=0.3)
        statuses = batch.wait()
        assert TransferStatus.TIMEOUT in statuses
        snapshot = hashlib.sha256(local.view).hexdigest()
        time.sleep(1.0)  # any RDMA READ still running would land in this second
        assert hashlib.sha256(local.view).hexdigest() == snapshot
        # The timed-out QPs were replaced: the next transfer runs over RDMA again.
        before = engine.stats().transports["rdma"].bytes_read
        engine.read(local, 0, peer.name, peer.regions["shared"], 0, MiB)
        assert local.view[:MiB] == pattern(7, MiB)[:MiB].data
        assert engine.stats().transports["rdma"].bytes_read == before + MiB


@pytest.fixture
def netdev() -> Iterator[str]:
    name = _rdma_netdev()
    yield name
    subprocess.run(["ip", "link", "set", "dev", name, "up"], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to take the netdev down")
def test_netdev_down_mid_batch_completes_over_tcp(engine: TransferEngine, netdev: str) -> None:
    local = engine.register(np.zeros(BLOCKS * MiB, dtype=np.uint8))
    with PeerProcess(config={"transport": "rdma"}, shared=BLOCKS * MiB + MiB, seed=8) as peer:
        engine.read(local, 0, peer.name, peer.regions["shared"], 0, MiB)
        local.view[:] = b"\0" * (BLOCKS * MiB)
        batch = engine.submit(TransferOp.READ, _reads(local, peer, BLOCKS), timeout=120)
        subprocess.run(["ip", "link", "set", "dev", netdev, "down"], check=True)
        assert all(s is TransferStatus.COMPLETED for s in batch.wait()), batch.errors
        expected = pattern(8, BLOCKS * MiB + MiB)
        assert local.view[:] == expected[5 : BLOCKS * MiB + 5].data
        stats = engine.stats().transports
        assert stats["tcp"].bytes_read > 0, "nothing fell back to TCP: the fault came too late"
        assert stats["rdma"].retries > 0
    # An engine started while the port is down runs without RDMA (auto) or refuses (forced).
    with TransferEngine(TransferConfig()) as plain:
        assert "rdma" not in plain.segment.endpoints
    forced = TransferEngine(TransferConfig(transport="rdma"))
    with pytest.raises(ConfigError, match="not active"):
        forced.start()
    forced.close()
