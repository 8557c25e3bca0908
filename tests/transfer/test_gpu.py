"""Real CUDA memory (torch): registered, transferred over every transport, bytes verified.

Skipped where no CUDA device is present; the logic around these paths is covered on CPU by
test_staging.py.
"""

from __future__ import annotations

import hashlib

import pytest

from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import MemoryKind, TransferConfig, TransferEngine

pytestmark = [pytest.mark.gpu, pytest.mark.integration]
MiB = 1 << 20


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_torch_cuda_tensor_round_trip(transport: str) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    tensor = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    with (
        TransferEngine(TransferConfig(transport=transport)) as engine,  # type: ignore[arg-type]
        PeerProcess(config={"transport": transport}, shared=8 * MiB, seed=51) as peer,
    ):
        region = engine.register(tensor)
        assert region.kind is MemoryKind.CUDA
        engine.read(region, 0, peer.name, peer.regions["shared"], 0, 8 * MiB)
        torch.cuda.synchronize()
        assert bytes(tensor.cpu().numpy()) == pattern(51, 8 * MiB).tobytes()
        tensor.add_(1)
        torch.cuda.synchronize()
        engine.write(region, 0, peer.name, peer.regions["shared"], 0, 8 * MiB)
        want = hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()
        assert peer.sha256("shared", 0, 8 * MiB) == want


def test_cuda_target_region_served_over_tcp() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    config = TransferConfig(transport="tcp")
    with TransferEngine(config) as target, TransferEngine(config) as engine:
        tensor = torch.arange(MiB, dtype=torch.int32, device="cuda")
        remote = target.register(tensor)
        local = engine.register(bytearray(4 * MiB))
        engine.read(local, 0, target.name, remote.id, 0, 4 * MiB)
        assert bytes(local.view) == tensor.cpu().numpy().tobytes()
