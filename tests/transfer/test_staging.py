"""Device-memory paths, exercised on CPU: a fake device array (host memory behind
``__cuda_array_interface__``) and a copier that records its copies."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import MemoryKind, TransferConfig, TransferEngine
from tests.support.fakes import FakeCudaArray, HostCopier

MiB = 1 << 20
pytestmark = pytest.mark.integration


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_initiator_device_memory_over_other_process(transport: str) -> None:
    copier = HostCopier()
    config = TransferConfig(transport=transport)  # type: ignore[arg-type]
    with (
        TransferEngine(config, device_copier=copier) as engine,
        PeerProcess(config={"transport": transport}, shared=4 * MiB, seed=21) as peer,
    ):
        device = FakeCudaArray(np.zeros(4 * MiB, dtype=np.uint8))
        region = engine.register(device)
        assert region.kind is MemoryKind.CUDA
        engine.read(region, 0, peer.name, peer.regions["shared"], 0, 3 * MiB + 5)
        assert device.host[: 3 * MiB + 5].tobytes() == pattern(21, 4 * MiB)[: 3 * MiB + 5].tobytes()
        device.host[:] = pattern(22, 4 * MiB)
        engine.write(region, 7, peer.name, peer.regions["shared"], 9, 2 * MiB)
        want = hashlib.sha256(device.host[7 : 7 + 2 * MiB]).hexdigest()
        assert peer.sha256("shared", 9, 2 * MiB) == want
    assert copier.copies > 0  # every byte went through the device copier
    if transport == "tcp":
        assert copier.pinned > 0  # TCP cannot reach device memory: it staged


def test_target_device_memory_is_staged_by_the_listener() -> None:
    copier = HostCopier()
    config = TransferConfig(transport="tcp")
    with (
        TransferEngine(config, device_copier=copier) as target,
        TransferEngine(config) as engine,
    ):
        device = FakeCudaArray(pattern(31, 8 * MiB).copy())
        remote = target.register(device)
        local = engine.register(np.zeros(8 * MiB, dtype=np.uint8))
        engine.read(local, 0, target.name, remote.id, 0, 8 * MiB)
        assert local.view == device.host.data
        local.view[:] = pattern(32, 8 * MiB).data
        engine.write(local, 0, target.name, remote.id, 0, 8 * MiB)
        assert device.host.tobytes() == pattern(32, 8 * MiB).tobytes()
    assert copier.pinned > 0
    assert copier.copies >= 2


def test_same_process_device_to_device_uses_the_copier() -> None:
    copier = HostCopier()
    config = TransferConfig(transport="local")
    with (
        TransferEngine(config, device_copier=copier) as target,
        TransferEngine(config, device_copier=copier) as engine,
    ):
        src = FakeCudaArray(pattern(41, MiB).copy())
        dst = FakeCudaArray(np.zeros(MiB, dtype=np.uint8))
        remote = target.register(src)
        local = engine.register(dst)
        engine.read(local, 0, target.name, remote.id, 0, MiB)
        assert dst.host.tobytes() == src.host.tobytes()
    assert copier.copies == 1
