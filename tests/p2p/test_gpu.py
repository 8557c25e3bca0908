"""Fetching straight into CUDA memory and serving from it (runs where a GPU is; skipped
cleanly elsewhere)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconnect.bench.etcd import EtcdServer, etcd_available
from kvconnect.p2p import Buffers, P2PConfig, P2PNode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not etcd_available(), reason="needs etcd"),
]

SIZES = {"a.safetensors": 3 * 4096 + 17, "b.safetensors": 4096}


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


def test_fetch_into_cuda_memory_and_serve_from_it(etcd: EtcdServer, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    for name, size in SIZES.items():
        (tmp_path / name).write_bytes(os.urandom(size))
    config = P2PConfig.from_mapping({"etcd": etcd.url, "chunk_bytes": 4096})
    device = {n: torch.zeros(s, dtype=torch.uint8, device="cuda") for n, s in SIZES.items()}
    pinned = {n: torch.zeros(s, dtype=torch.uint8).pin_memory() for n, s in SIZES.items()}
    with P2PNode(config) as publisher, P2PNode(config) as gpu, P2PNode(config) as late:
        publisher.publish(tmp_path, "weights")
        gpu.fetch("weights", Buffers(device))
        publisher.close()  # what follows comes from the GPU holder only
        _, stats = late.fetch("weights", Buffers(pinned))
        assert set(stats.by_holder) == {gpu.segment}
    for name in SIZES:
        expected = (tmp_path / name).read_bytes()
        assert bytes(device[name].cpu().numpy()) == expected
        assert bytes(pinned[name].numpy()) == expected
