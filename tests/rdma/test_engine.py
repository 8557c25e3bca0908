"""The engine with its RDMA transport: routing in auto mode and configuration errors."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvconnect.errors import ConfigError
from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import TransferConfig, TransferEngine
from tests.support.hardware import rdma_present

MiB = 1 << 20


@pytest.mark.skipif(rdma_present(), reason="this host has an RDMA device")
def test_forcing_rdma_without_a_device_is_a_config_error() -> None:
    engine = TransferEngine(TransferConfig(transport="rdma"))
    with pytest.raises(ConfigError, match="no RDMA device is usable"):
        engine.start()
    engine.close()


@pytest.mark.rdma
def test_an_unknown_nic_in_the_allow_list_is_refused() -> None:
    engine = TransferEngine(TransferConfig(transport="rdma", rdma_nics="nosuchdev0"))
    with pytest.raises(ConfigError, match=r"unknown devices \['nosuchdev0'\]"):
        engine.start()
    engine.close()


@pytest.mark.rdma
@pytest.mark.integration
def test_auto_sends_private_regions_over_rdma_and_shared_ones_over_shm() -> None:
    with (
        TransferEngine(TransferConfig()) as engine,
        PeerProcess(shared=MiB, private=MiB, seed=3) as peer,
    ):
        assert "rdma" in engine.segment.endpoints
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        engine.read(local, 0, peer.name, peer.regions["private"], 0, MiB)
        assert local.view[:] == pattern(4, MiB).data
        engine.read(local, 0, peer.name, peer.regions["shared"], 0, MiB)
        assert local.view[:] == pattern(3, MiB).data
        stats = engine.stats().transports
        assert stats["rdma"].bytes_read == MiB
        assert stats["shm"].bytes_read == MiB
        assert stats["tcp"].bytes_read == 0


@pytest.mark.rdma
def test_closing_an_initiator_releases_the_queue_pairs_its_peer_kept() -> None:
    config = TransferConfig(transport="rdma", rdma_qps_per_peer=3)
    with TransferEngine(config) as target:
        region = target.register(np.arange(MiB, dtype=np.uint64).view(np.uint8)[:MiB])
        with TransferEngine(config) as initiator:
            local = initiator.register(np.zeros(MiB, dtype=np.uint8))
            initiator.read(local, 0, target.name, region.id, 0, MiB)
            assert local.view[:] == region.view[:]
            served = target._rdma._served  # type: ignore[union-attr]
            assert len(served) == 3  # one responder QP per slot
        assert served == {}, "the peer still keeps QPs of a closed initiator"


@pytest.mark.rdma
def test_the_completion_thread_sleeps_on_the_real_completion_channel() -> None:
    with TransferEngine(TransferConfig(transport="rdma")) as engine:
        nics = engine._rdma._nics.values()  # type: ignore[union-attr]
        for nic in nics:
            # Not the 1 ms polling fallback: the fd poll() waits on is the channel's.
            assert nic.channel_fd >= 0
            assert "infinibandevent" in os.readlink(f"/proc/self/fd/{nic.channel_fd}")
