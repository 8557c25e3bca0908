"""vLLM's paged KV tensors as registered memory: one region per storage, a layout per layer.

Runs in vLLM's worker processes (imports torch lazily through the tensors it is given).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from kvconnect.errors import ConfigError
from kvconnect.transfer.engine import TransferEngine
from kvconnect.transfer.memory import MemoryRegion
from kvconnect.vllm.layout import LayerLayout


def register_kv_caches(
    engine: TransferEngine,
    kv_caches: Mapping[str, Any],
    num_blocks: int,
    groups: Mapping[str, int] | None = None,
) -> tuple[list[LayerLayout], dict[int, MemoryRegion]]:
    """Register every storage behind ``kv_caches`` once; returns each layer's layout (in
    layer-name order, tagged with its KV-cache group from ``groups``, 0 if absent) and the
    regions by id. Raises ConfigError for a layout whose blocks are not made of contiguous
    ranges. Mamba layers come as vLLM 0.32/0.33 give them, one int8 ``[blocks, …]`` view of
    their state pages: the same kind of layout as attention's."""
    regions: dict[int, MemoryRegion] = {}
    by_storage: dict[int, MemoryRegion] = {}
    layers: list[LayerLayout] = []
    for name in sorted(kv_caches):
        tensor = kv_caches[name]
        storage = tensor.untyped_storage()
        base = storage.data_ptr()
        region = by_storage.get(base)
        if region is None:
            flat = tensor.new_empty(0, dtype=_uint8()).set_(storage)
            region = by_storage[base] = engine.register(flat)
            regions[region.id] = region
        layer = describe_layer(name, tensor, region.id, tensor.data_ptr() - base, num_blocks)
        layers.append(msgspec.structs.replace(layer, group=(groups or {}).get(name, 0)))
    return layers, regions


def describe_layer(
    name: str, tensor: Any, region: int, offset: int, num_blocks: int
) -> LayerLayout:
    """Where ``tensor``'s blocks are: the block dimension is the one of ``num_blocks`` entries
    after which each block fills one contiguous range (its dimensions in any order of
    strides: vLLM permutes strides for HND layouts); at most one dimension (K/V) may come
    before it."""
    shape = tuple(tensor.shape)
    strides = tuple(tensor.stride())
    item = tensor.element_size()
    for dim in range(min(2, len(shape))):
        if shape[dim] != num_blocks or not _dense(shape[dim + 1 :], strides[dim + 1 :]):
            continue
        chunks, chunk_stride = (shape[0], strides[0] * item) if dim == 1 else (1, 0)
        return LayerLayout(
            name=name,
            region=region,
            offset=offset,
            chunks=chunks,
            chunk_stride=chunk_stride,
            num_blocks=num_blocks,
            block_stride=strides[dim] * item,
            block_bytes=math.prod(shape[dim + 1 :]) * item,
            block_shape=shape[dim + 1 :],
            block_strides=strides[dim + 1 :],
            dtype=str(tensor.dtype),
        )
    raise ConfigError(
        f"KV cache layer {name} has shape {shape} and strides {strides}: kvconnect needs "
        f"{num_blocks} blocks of contiguous bytes in dimension 0 or 1"
    )


def _dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """The elements fill one contiguous range, whatever the order of the dimensions."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides, strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _uint8() -> Any:
    import torch  # the worker process has it; kvconnect does not depend on it

    return torch.uint8
