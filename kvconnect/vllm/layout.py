"""Where each block of the paged KV cache lives in registered memory. Pure: no torch.

vLLM gives the connector one tensor per attention layer. In every layout it uses, a layer is
``chunks`` (1, or 2 when K and V are the outermost dimension) times ``num_blocks`` blocks of
``block_bytes`` contiguous bytes, ``block_stride`` apart. Reading a block therefore means
``layers x chunks`` contiguous ranges; consecutive blocks on both sides merge into one range
when blocks are densely packed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec


class LayerLayout(msgspec.Struct, frozen=True, array_like=True):
    """One layer's blocks inside a registered region."""

    name: str
    region: int
    """Transfer-engine region id holding the layer."""
    offset: int
    """Byte offset of the layer's first element in the region."""
    chunks: int
    chunk_stride: int
    num_blocks: int
    block_stride: int
    block_bytes: int

    def block_offset(self, chunk: int, block: int) -> int:
        """Offset in the region of ``block``'s bytes of ``chunk``."""
        return self.offset + chunk * self.chunk_stride + block * self.block_stride

    @property
    def dense(self) -> bool:
        """Consecutive blocks are adjacent in memory."""
        return self.block_stride == self.block_bytes


class RankLayout(msgspec.Struct, frozen=True, array_like=True):
    """What a peer needs to read one TP rank's KV cache."""

    segment: str
    """The rank's transfer-engine segment name."""
    compat: str
    """:func:`compat_hash` of the rank's KV format."""
    layers: tuple[LayerLayout, ...]


def compat_hash(fields: Sequence[object], layers: Sequence[LayerLayout]) -> str:
    """Equal for two ranks exactly when their blocks are interchangeable byte for byte: same
    ``fields`` (model, dtype, block size, TP size and rank layout …) and per layer the same
    name, chunk count and block size."""
    digest = hashlib.sha256(repr(tuple(fields)).encode())
    for layer in layers:
        digest.update(repr((layer.name, layer.chunks, layer.block_bytes)).encode())
    return digest.hexdigest()[:32]


def block_runs(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(local_first, remote_first, count)`` for maximal runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for lo, re in zip(local, remote, strict=True):
        if runs:
            first_lo, first_re, count = runs[-1]
            if lo == first_lo + count and re == first_re + count:
                runs[-1] = (first_lo, first_re, count + 1)
                continue
        runs.append((lo, re, 1))
    return runs


def range_pairs(
    local: LayerLayout, remote: LayerLayout, runs: Sequence[tuple[int, int, int]]
) -> list[tuple[int, int, int]]:
    """``(local_offset, remote_offset, length)`` covering ``runs`` of blocks in one layer."""
    pairs: list[tuple[int, int, int]] = []
    merge = local.dense and remote.dense
    for chunk in range(local.chunks):
        for lo, re, count in runs:
            if merge:
                pairs.append(
                    (
                        local.block_offset(chunk, lo),
                        remote.block_offset(chunk, re),
                        count * local.block_bytes,
                    )
                )
                continue
            for i in range(count):
                pairs.append(
                    (
                        local.block_offset(chunk, lo + i),
                        remote.block_offset(chunk, re + i),
                        local.block_bytes,
                    )
                )
    return pairs


def check_compatible(local: RankLayout, remote: RankLayout) -> str | None:
    """Why ``remote``'s blocks cannot be read into ``local``'s, or None."""
    if local.compat != remote.compat:
        return (
            f"KV format differs (compatibility hash {remote.compat} at the peer, "
            f"{local.compat} here): same model, dtype, block size, TP size and KV layout needed"
        )
    if len(local.layers) != len(remote.layers):
        return f"peer has {len(remote.layers)} KV layers, this engine {len(local.layers)}"
    return None
