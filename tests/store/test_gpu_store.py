"""GPU memory straight to and from the store (torch CUDA tensors); skipped without a GPU."""

from __future__ import annotations

import pytest

from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster
from kvconnect.store.messages import Code
from kvconnect.transfer import TransferConfig

pytestmark = [pytest.mark.gpu, pytest.mark.integration]
MiB = 1 << 20


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_cuda_kv_pages_round_trip(transport: str) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    with Cluster(servers=1, server_size=64 * MiB) as cluster:
        config = StoreClientConfig(master=cluster.master_endpoint)
        with StoreClient(config, TransferConfig(transport=transport)) as client:  # type: ignore[arg-type]
            pages = torch.randint(0, 255, (8, MiB), dtype=torch.uint8, device="cuda")
            region = client.register(pages)
            keys = [f"gpu-{i}" for i in range(8)]
            offsets = [i * MiB for i in range(8)]
            assert client.batch_put_from(keys, region, offsets, [MiB] * 8).codes == (Code.OK,) * 8
            copy = torch.zeros_like(pages)
            target = client.register(copy)
            assert client.batch_get_into(keys, target, offsets, [MiB] * 8).leading() == 8
            torch.cuda.synchronize()
            assert torch.equal(copy, pages)
