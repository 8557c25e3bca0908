"""Block layouts and KV-format compatibility (kvconnect/vllm/layout.py): every environment
(torch for the tensor layouts compared)."""

from __future__ import annotations

import msgspec
import pytest

from kvconnect.vllm.layout import (
    KVFormat,
    LayerLayout,
    RankLayout,
    block_runs,
    check_compatible,
    compat_hash,
    range_pairs,
)


def test_block_runs_merge_what_is_consecutive_on_both_sides() -> None:
    assert block_runs([4, 5, 6, 9], [1, 2, 7, 8]) == [(4, 1, 2), (6, 7, 1), (9, 8, 1)]
    assert block_runs([], []) == []


def test_ranges_cover_every_chunk_of_every_block() -> None:
    # K and V outermost: chunk stride 1000, blocks of 10 bytes 10 apart (dense)
    local = LayerLayout("l", 1, 0, 2, 1000, 100, 10, 10)
    remote = LayerLayout("l", 7, 50, 2, 2000, 200, 10, 10)
    assert range_pairs(local, remote, [4, 5], [1, 2]) == [(40, 60, 20), (1040, 2060, 20)]
    sparse = LayerLayout("l", 1, 0, 1, 0, 100, 16, 10)  # padded blocks: one range per block
    assert range_pairs(sparse, sparse, [0, 1], [2, 3]) == [(0, 32, 10), (16, 48, 10)]


def _rank(layer: LayerLayout, **changes: object) -> RankLayout:
    fmt = msgspec.structs.replace(
        KVFormat("vllm 0.33.0", "m", "", "auto/float16", 16, 1, "FLASH_ATTN", "NHD"), **changes
    )
    return RankLayout("segment", compat_hash(fmt, [layer, layer]), (layer, layer), fmt)


def test_compatibility_names_every_field_that_differs() -> None:
    torch = pytest.importorskip("torch")
    from kvconnect.vllm.kvcache import describe_layer

    nhd = describe_layer("l", torch.zeros(2, 8, 16, 4, 64), 1, 0, num_blocks=8)
    hnd = describe_layer("l", torch.zeros(2, 8, 4, 16, 64), 1, 0, num_blocks=8)
    mine = _rank(nhd)
    assert check_compatible(mine, _rank(nhd)) is None
    assert check_compatible(mine, msgspec.structs.replace(_rank(nhd), segment="other")) is None
    theirs = _rank(hnd, attention_backend="FLASHINFER")
    assert theirs.compat != mine.compat
    assert check_compatible(mine, theirs) == (
        "attention_backend: 'FLASHINFER' at the peer, 'FLASH_ATTN' here; "
        "layer l block_shape: (4, 16, 64) at the peer, (16, 4, 64) here; "
        "layer l block_strides: (1024, 64, 1) at the peer, (256, 64, 1) here; "
        "and 1 more layers differ"
    )
    for field, value in (("engine", "vllm 0.32.0"), ("revision", "abc"), ("kv_layout", "HND")):
        problem = check_compatible(mine, _rank(nhd, **{field: value}))
        assert problem is not None
        assert problem.startswith(f"{field}: {value!r} at the peer"), problem
