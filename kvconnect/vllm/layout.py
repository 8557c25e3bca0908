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

from kvconnect.errors import ConfigError

FORMAT_VERSION = 3  # 3: layers carry their KV-cache group
"""kvconnect's own block format (what :class:`LayerLayout` describes)."""


class IncompatiblePeer(ConfigError):
    """A peer's KV blocks mean something else than this engine's: never read them."""


class KVFormat(msgspec.Struct, frozen=True):
    """What gives an engine's KV bytes their meaning, besides where they lie. Two ranks'
    blocks are interchangeable only when every field is equal (and so are their layers')."""

    engine: str
    """The inference engine and its version, e.g. ``vllm 0.33.0``."""
    model: str
    revision: str
    """The model's revision (empty: whatever the path holds)."""
    dtype: str
    """KV cache dtype / model dtype."""
    block_size: int
    tp_size: int
    attention_backend: str
    kv_layout: str
    """The engine's name for the order of a block's dimensions (e.g. vLLM's NHD/HND family)."""
    kvconnect: int = FORMAT_VERSION


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
    block_shape: tuple[int, ...] = ()
    """Shape of one block (the tensor's dimensions after the block dimension)."""
    block_strides: tuple[int, ...] = ()
    """Their strides in elements: with the shape, the order of the bytes (NHD vs HND)."""
    dtype: str = ""
    """Element type."""
    group: int = 0
    """The vLLM KV-cache group whose block ids index this layer."""
    first_head: int = 0
    """The first of the model's KV heads this rank's blocks hold (see :mod:`.tpmap`)."""
    total_heads: int = 0
    """The layer's KV heads over all TP ranks (1 for MLA's latent); 0: unknown, the blocks
    are read only by an identical peer."""
    kv_halves: bool = False
    """Each head's part of a block holds all its tokens' K, then all their V (vLLM's CPU
    attention), instead of each token's K and V together."""

    def block_offset(self, chunk: int, block: int) -> int:
        """Offset in the region of ``block``'s bytes of ``chunk``."""
        return self.offset + chunk * self.chunk_stride + block * self.block_stride

    @property
    def dense(self) -> bool:
        """Consecutive blocks are adjacent in memory."""
        return self.block_stride == self.block_bytes


_LAYER_FORMAT = (
    "name",
    "chunks",
    "block_bytes",
    "block_shape",
    "block_strides",
    "dtype",
    "group",
)
"""The fields of a layer that give its bytes their meaning (the others say where they are)."""


class RankLayout(msgspec.Struct, frozen=True, array_like=True):
    """What a peer needs to read one TP rank's KV cache."""

    segment: str
    """The rank's transfer-engine segment name."""
    compat: str
    """:func:`compat_hash` of the rank's KV format."""
    layers: tuple[LayerLayout, ...]
    format: KVFormat


def compat_hash(fmt: KVFormat, layers: Sequence[LayerLayout]) -> str:
    """Equal for two ranks exactly when their blocks are interchangeable byte for byte: same
    ``fmt`` and per layer the same name, chunks, block size, shape, strides and dtype."""
    layer_formats = [[getattr(layer, f) for f in _LAYER_FORMAT] for layer in layers]
    return hashlib.sha256(msgspec.msgpack.encode([fmt, layer_formats])).hexdigest()[:32]


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


def block_ranges(layer: LayerLayout, blocks: Sequence[int]) -> list[tuple[int, int]]:
    """``(offset, length)`` of each of ``blocks`` (ids of the layer's KV-cache group) in the
    layer's region, block by block, chunk by chunk within a block."""
    return [
        (layer.block_offset(chunk, block), layer.block_bytes)
        for block in blocks
        for chunk in range(layer.chunks)
    ]


def range_pairs(
    local: LayerLayout,
    remote: LayerLayout,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
) -> list[tuple[int, int, int]]:
    """``(local_offset, remote_offset, length)`` covering ``remote_blocks`` of one layer read
    into ``local_blocks`` (pairwise; block ids of the layer's KV-cache group), runs of
    consecutive blocks merged where both sides are dense."""
    runs = block_runs(local_blocks, remote_blocks)
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
    """Why ``remote``'s blocks cannot be read into ``local``'s (every field that differs), or
    None."""
    problems = _differences("", remote.format, local.format, KVFormat.__struct_fields__)
    if len(local.layers) != len(remote.layers):
        problems.append(f"KV layers: {len(remote.layers)} at the peer, {len(local.layers)} here")
    else:
        layers = [
            _differences(f"layer {mine.name} ", theirs, mine, _LAYER_FORMAT)
            for mine, theirs in zip(local.layers, remote.layers, strict=True)
        ]
        differing = [p for p in layers if p]
        if differing:
            problems.extend(differing[0])
            if len(differing) > 1:
                problems.append(f"and {len(differing) - 1} more layers differ")
    if not problems and local.compat != remote.compat:
        problems.append(f"compatibility hash: {remote.compat} at the peer, {local.compat} here")
    return "; ".join(problems) or None


def _differences(prefix: str, theirs: object, mine: object, fields: Sequence[str]) -> list[str]:
    return [
        f"{prefix}{name}: {getattr(theirs, name)!r} at the peer, {getattr(mine, name)!r} here"
        for name in fields
        if getattr(theirs, name) != getattr(mine, name)
    ]
