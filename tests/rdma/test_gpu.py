"""GPU memory straight to the wire (GPUDirect RDMA): dmabuf or peer-memory MRs over CUDA memory.

Needs a CUDA GPU and an RDMA NIC that can reach it (nvidia-peermem loaded, or a driver with
dmabuf support); skipped elsewhere (docs/rdma.md says how to verify a host by hand).
"""

from __future__ import annotations

import hashlib

import pytest

from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import TransferConfig, TransferEngine

pytestmark = [pytest.mark.gpu, pytest.mark.rdma, pytest.mark.integration]

SIZE = 16 << 20


def test_gpu_memory_moves_over_rdma_both_ways() -> None:
    torch = pytest.importorskip("torch")
    with (
        TransferEngine(TransferConfig(transport="rdma")) as engine,
        PeerProcess(config={"transport": "rdma"}, shared=SIZE, seed=9) as peer,
    ):
        gpu = torch.zeros(SIZE, dtype=torch.uint8, device="cuda")
        local = engine.register(gpu)
        region = peer.regions["shared"]
        engine.read(local, 0, peer.name, region, 0, SIZE)
        assert hashlib.sha256(gpu.cpu().numpy()).hexdigest() == peer.sha256("shared", 0, SIZE)
        gpu.copy_(torch.from_numpy(pattern(10, SIZE).copy()).to("cuda"))
        engine.write(local, 0, peer.name, region, 0, SIZE)
        assert peer.sha256("shared", 0, SIZE) == hashlib.sha256(pattern(10, SIZE)).hexdigest()
        stats = engine.stats().transports
        # Straight from and to device memory: nothing was staged through TCP.
        assert stats["rdma"].bytes_read == stats["rdma"].bytes_written == SIZE
        assert stats["tcp"].bytes_read == stats["tcp"].bytes_written == 0
