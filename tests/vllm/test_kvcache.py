"""How vLLM's KV tensors are described (kvconnect/vllm/kvcache.py): every environment with
torch."""

from __future__ import annotations

import pytest

from kvconnect.errors import ConfigError


def test_kv_tensor_layouts_are_understood() -> None:
    torch = pytest.importorskip("torch")
    from kvconnect.vllm.kvcache import describe_layer

    kv_first = torch.zeros(2, 8, 16, 4, 64)  # [K|V, blocks, tokens, heads, dim] (flash)
    layer = describe_layer("a", kv_first, 1, 0, num_blocks=8)
    assert (layer.chunks, layer.block_bytes, layer.block_stride) == (2, 16 * 4 * 64 * 4, 16384)
    assert layer.chunk_stride == 8 * 16384
    blocks_first = torch.zeros(8, 2, 16, 64)  # [blocks, K|V, tokens, dim] (CPU)
    layer = describe_layer("b", blocks_first, 1, 0, num_blocks=8)
    assert (layer.chunks, layer.block_bytes) == (1, 2 * 16 * 64 * 4)
    with pytest.raises(ConfigError, match="contiguous"):
        describe_layer("c", torch.zeros(16, 8, 64).transpose(0, 1), 1, 0, num_blocks=8)
    # HND in memory behind NHD's shape (vLLM permutes strides): each block is still one range
    hnd = describe_layer("d", torch.zeros(2, 8, 4, 16, 64).transpose(2, 3), 1, 0, num_blocks=8)
    nhd = describe_layer("d", torch.zeros(2, 8, 16, 4, 64), 1, 0, num_blocks=8)
    assert (hnd.block_bytes, hnd.block_shape, hnd.dtype) == (
        nhd.block_bytes,
        (16, 4, 64),
        "torch.float32",
    )
    assert (hnd.block_strides, nhd.block_strides) == ((64, 1024, 1), (256, 64, 1))
