"""Which bytes of which prefill ranks a decode rank reads when the two engines differ in TP
size, block size or the order of a block's dimensions. Pure: no torch, no I/O.

vLLM hands connectors each attention layer as a logical ``[blocks, heads, tokens, content]``
tensor (``content``: one token's K and V of one head, contiguous; MLA has one "head", its
latent), its strides permuted by the KV layout (``LBHNC``: heads outer, ``LBNHC``: tokens
outer). vLLM's CPU attention reads the same bytes as ``[blocks, heads, 2 x tokens, head_size]``
instead: each head's part of a block is all its tokens' K, then all their V ("K/V halves").
TP rank ``r`` of ``t`` holds KV heads ``[r*T/t, (r+1)*T/t)`` of the layer's ``T``; when
``T < t`` every head is replicated on ``t/T`` ranks and rank ``r`` holds head ``r // (t/T)``
(MLA: ``T == 1``, the latent on every rank). A decode rank reads each head it holds once,
from one prefill rank that has it, token by token across block boundaries: the unit of a
read is one token of one head (``row`` bytes; of its K or its V with K/V halves), and rows
contiguous on both sides merge.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import msgspec

from kvconnect.vllm.layout import KVFormat, LayerLayout, RankLayout

_HEAD_AXIS, _TOKEN_AXIS = 0, 1  # of a block's logical shape (heads, tokens, content)
_SAME_FORMAT = ("engine", "model", "revision", "dtype", "attention_backend", "kvconnect")
"""The fields of :class:`KVFormat` a mapped read needs equal (TP size, block size and the
KV layout are what it maps between)."""
KV_HALVES_BACKENDS = frozenset({"CPU_ATTN"})
"""vLLM attention backends whose blocks hold K/V halves (``kv_cache.view(blocks, heads,
2 * block_size, head_size).chunk(2, dim=2)`` in vLLM's CPU attention)."""
BLOCK_PACKED_BACKENDS = frozenset({"CPU_ATTN"})
"""vLLM attention backends whose kernels lay a block's tokens out by the block size (vLLM's CPU
attention picks its kernel, and with it the cache's order inside a block, by block size):
blocks of another size cannot be mapped token by token. Found end to end (P 32 → D 64 read
every byte, and decode's output differed); equal block sizes map heads only, whole blocks."""


class Span(NamedTuple):
    """One contiguous range to read: ``length`` bytes at ``remote`` in the layer's region of
    prefill rank ``rank`` into ``local`` in this rank's region."""

    rank: int
    local: int
    remote: int
    length: int


class _Segment(NamedTuple):
    """Tokens that lie in one block on both sides."""

    local_block: int
    local_token: int  # first token's position in the local block
    remote_block: int
    remote_token: int
    tokens: int


def head_range(tp_rank: int, tp_size: int, total_heads: int) -> tuple[int, int]:
    """``(first, count)`` of the KV heads that TP rank ``tp_rank`` of ``tp_size`` holds, by
    vLLM's split (replicated when there are fewer heads than ranks). Raises ValueError when
    the heads do not split evenly."""
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise ValueError(f"{total_heads} KV heads do not split over {tp_size} ranks")
        count = total_heads // tp_size
        return tp_rank * count, count
    if tp_size % total_heads:
        raise ValueError(f"{total_heads} KV heads do not replicate over {tp_size} ranks")
    return tp_rank // (tp_size // total_heads), 1


def with_heads(
    layer: LayerLayout,
    tp_rank: int,
    tp_size: int,
    total_heads: int,
    block_size: int,
    *,
    kv_halves: bool = False,
) -> LayerLayout:
    """``layer`` with the heads it holds, when its blocks have vLLM's logical (heads, tokens,
    content) shape with contiguous content (``kv_halves``: its backend keeps K/V halves, which
    needs each head's tokens contiguous); else ``layer`` unchanged (its geometry unknown: only
    an identical peer can be read)."""
    shape, strides = layer.block_shape, layer.block_strides
    if total_heads <= 0 or len(shape) != 3 or strides[2] != 1:
        return layer
    if kv_halves and (shape[2] % 2 or strides[1] != shape[2] or strides[0] != shape[1] * shape[2]):
        return layer
    try:
        first, count = head_range(tp_rank, tp_size, total_heads)
    except ValueError:
        return layer
    if shape[_HEAD_AXIS] != count or shape[_TOKEN_AXIS] != block_size:
        return layer
    return msgspec.structs.replace(
        layer, first_head=first, total_heads=total_heads, kv_halves=kv_halves
    )


def mapped(layer: LayerLayout) -> bool:
    """The layer says which heads it holds (:func:`with_heads`)."""
    return layer.total_heads > 0


def row_bytes(layer: LayerLayout) -> int:
    """Bytes of one token of one head (of its K or its V with K/V halves): contiguous."""
    return layer.block_shape[2] * _item(layer) // (2 if layer.kv_halves else 1)


def block_pairs(
    local_blocks: Sequence[int], remote_blocks: Sequence[int], first_token: int, block_size: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Equal block sizes: the remote blocks paired with ``local_blocks`` (whose first starts
    at token ``first_token`` of the remote's, a multiple of ``block_size``)."""
    skip = first_token // block_size
    count = max(0, min(len(local_blocks), len(remote_blocks) - skip))
    return tuple(local_blocks[:count]), tuple(remote_blocks[skip : skip + count])


def sources(
    local: LayerLayout, remotes: Mapping[int, LayerLayout], tp_rank: int
) -> list[tuple[int, int, int]]:
    """``(remote_rank, first_head, count)`` giving every head ``local`` holds exactly once.
    A head replicated on several remote ranks comes from one of them, chosen by ``tp_rank``
    so that decode ranks spread over them. Raises ValueError for a head no remote holds."""
    wanted = range(local.first_head, local.first_head + local.block_shape[_HEAD_AXIS])
    holders: dict[int, list[int]] = {}
    for rank in sorted(remotes):
        layer = remotes[rank]
        first = layer.first_head
        for head in range(first, first + layer.block_shape[_HEAD_AXIS]):
            holders.setdefault(head, []).append(rank)
    picks: list[tuple[int, int, int]] = []
    for head in wanted:
        ranks = holders.get(head)
        if not ranks:
            raise ValueError(f"no prefill rank holds KV head {head} of {local.name}")
        rank = ranks[tp_rank % len(ranks)]
        last = picks[-1] if picks else None
        if last is not None and last[0] == rank and last[1] + last[2] == head:
            picks[-1] = (rank, last[1], last[2] + 1)
        else:
            picks.append((rank, head, 1))
    return picks


def segments(
    local_blocks: Sequence[int],
    local_block_size: int,
    remote_blocks: Sequence[int],
    remote_block_size: int,
    first_token: int,
) -> list[_Segment]:
    """The tokens to read, cut where a block ends on either side. ``local_blocks[0]`` starts
    at token ``first_token`` of the request (a multiple of ``local_block_size``);
    ``remote_blocks`` hold the request from token 0. Reads what both sides have blocks for."""
    end = min(
        first_token + len(local_blocks) * local_block_size,
        len(remote_blocks) * remote_block_size,
    )
    cuts: list[_Segment] = []
    token = first_token
    while token < end:
        lt, rt = (token - first_token) % local_block_size, token % remote_block_size
        count = min(local_block_size - lt, remote_block_size - rt, end - token)
        cuts.append(
            _Segment(
                local_blocks[(token - first_token) // local_block_size],
                lt,
                remote_blocks[token // remote_block_size],
                rt,
                count,
            )
        )
        token += count
    return cuts


def layer_spans(
    local: LayerLayout,
    remotes: Mapping[int, LayerLayout],
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    first_token: int,
    tp_rank: int,
) -> list[Span]:
    """The ranges to read for one layer (of TP rank ``tp_rank``) from the same layer of the
    remote ranks ``remotes`` (their layers, by TP rank; all :func:`mapped`, with rows of the
    same size). Block ids and ``first_token`` as for :func:`segments`."""
    row = row_bytes(local)
    local_tokens = local.block_shape[_TOKEN_AXIS]
    spans: list[Span] = []
    for rank, first_head, count in sources(local, remotes, tp_rank):
        remote = remotes[rank]
        cuts = segments(
            local_blocks, local_tokens, remote_blocks, remote.block_shape[_TOKEN_AXIS], first_token
        )
        lh, rh = first_head - local.first_head, first_head - remote.first_head
        for chunk in range(local.chunks):
            for half in range(2 if local.kv_halves else 1):
                for cut in cuts:
                    lo = local.block_offset(chunk, cut.local_block)
                    lo += _at(local, cut.local_token, lh, half)
                    ro = remote.block_offset(chunk, cut.remote_block)
                    ro += _at(remote, cut.remote_token, rh, half)
                    for at, of, length in _rows(local, remote, lo, ro, cut.tokens, count, row):
                        _append(spans, Span(rank, at, of, length))
    return spans


def check_mappable(
    local: RankLayout, remotes: Mapping[int, RankLayout], *, strict: bool
) -> str | None:
    """Why ``local`` cannot read its heads from the prefill ranks ``remotes`` (all of them,
    by TP rank) through :func:`layer_spans`, or None. ``strict``: engine, model, revision,
    dtype and attention backend must also be equal (``enforce_compat``)."""
    tp_sizes = {r.format.tp_size for r in remotes.values()}
    if len(tp_sizes) != 1 or set(remotes) != set(range(tp_sizes.pop())):
        return f"prefill ranks {sorted(remotes)} are not one TP group"
    problems: list[str] = []
    for rank in sorted(remotes):
        theirs = remotes[rank]
        packed = _backends(theirs.format) | _backends(local.format)
        if theirs.format.block_size != local.format.block_size and packed & BLOCK_PACKED_BACKENDS:
            problems.append(
                f"block size: {theirs.format.block_size} at prefill rank {rank}, "
                f"{local.format.block_size} here, and {sorted(packed & BLOCK_PACKED_BACKENDS)} "
                "lays a block's tokens out by its block size"
            )
        if strict:
            problems += _format_differences(theirs.format, local.format)
        if len(theirs.layers) != len(local.layers):
            problems.append(
                f"KV layers: {len(theirs.layers)} at prefill rank {rank}, {len(local.layers)} here"
            )
        else:
            problems += _layer_problems(local.layers, theirs.layers)
        if problems:
            return "; ".join(problems)
    return None


def _backends(fmt: KVFormat) -> frozenset[str]:
    return frozenset(fmt.attention_backend.split(","))


def _layer_problems(mine: Sequence[LayerLayout], theirs: Sequence[LayerLayout]) -> list[str]:
    for local, remote in zip(mine, theirs, strict=True):
        if not (mapped(local) and mapped(remote)):
            return [f"layer {local.name}: heads and tokens of its blocks unknown on one side"]
        pairs = {
            "name": (remote.name, local.name),
            "chunks": (remote.chunks, local.chunks),
            "dtype": (remote.dtype, local.dtype),
            "K/V halves": (remote.kv_halves, local.kv_halves),
            "KV heads": (remote.total_heads, local.total_heads),
            "bytes per token and head": (row_bytes(remote), row_bytes(local)),
        }
        differing = [
            f"layer {local.name} {what}: {theirs_!r} at the peer, {mine_!r} here"
            for what, (theirs_, mine_) in pairs.items()
            if theirs_ != mine_
        ]
        if differing:
            return differing
    return []


def _format_differences(theirs: KVFormat, mine: KVFormat) -> list[str]:
    return [
        f"{name}: {getattr(theirs, name)!r} at the peer, {getattr(mine, name)!r} here"
        for name in _SAME_FORMAT
        if getattr(theirs, name) != getattr(mine, name)
    ]


def _item(layer: LayerLayout) -> int:
    return layer.block_bytes // math.prod(layer.block_shape)


def _strides(layer: LayerLayout) -> tuple[int, int]:
    """Bytes from one head to the next, and from one token to the next, in a block."""
    item = _item(layer)
    token = layer.block_strides[_TOKEN_AXIS] * item
    return layer.block_strides[_HEAD_AXIS] * item, token // 2 if layer.kv_halves else token


def _at(layer: LayerLayout, token: int, head: int, half: int) -> int:
    """Offset in a block of ``token``'s row of ``head`` (of its V when ``half`` is 1)."""
    head_stride, token_stride = _strides(layer)
    values = half * layer.block_shape[_TOKEN_AXIS] * token_stride  # 0 unless K/V halves
    return head * head_stride + token * token_stride + values


def _rows(
    local: LayerLayout, remote: LayerLayout, lo: int, ro: int, tokens: int, heads: int, row: int
) -> list[tuple[int, int, int]]:
    """``tokens`` x ``heads`` rows from ``ro`` to ``lo`` as the fewest ranges: tokens inner
    or heads inner, whichever merges more."""
    lh, lt = _strides(local)
    rh, rt = _strides(remote)
    by_heads = _grid(lo, ro, (tokens, lt, rt), (heads, lh, rh), row)
    if len(by_heads) == 1:
        return by_heads
    by_tokens = _grid(lo, ro, (heads, lh, rh), (tokens, lt, rt), row)
    return by_tokens if len(by_tokens) < len(by_heads) else by_heads


def _grid(
    lo: int, ro: int, inner: tuple[int, int, int], outer: tuple[int, int, int], row: int
) -> list[tuple[int, int, int]]:
    """Rows over ``(count, local_stride, remote_stride)`` of an inner and an outer dimension;
    a dimension of one row is contiguous whatever its stride."""
    n_in, l_in, r_in = inner if inner[0] > 1 else (1, row, row)
    n_out, l_out, r_out = outer
    if l_in == row and r_in == row:
        run = n_in * row
        if n_out == 1 or (l_out == run and r_out == run):
            return [(lo, ro, n_out * run)]
        return [(lo + j * l_out, ro + j * r_out, run) for j in range(n_out)]
    return [
        (lo + j * l_out + i * l_in, ro + j * r_out + i * r_in, row)
        for j in range(n_out)
        for i in range(n_in)
    ]


def _append(spans: list[Span], span: Span) -> None:
    """Add ``span``, merged into the last one when it continues it on both sides."""
    if spans:
        last = spans[-1]
        if (
            last.rank == span.rank
            and last.local + last.length == span.local
            and last.remote + last.length == span.remote
        ):
            spans[-1] = last._replace(length=last.length + span.length)
            return
    spans.append(span)
