"""Heterogeneous reads (kvconnect/vllm/tpmap.py), pure: regions are numpy byte arrays, each
row (one token of one head) tagged with its head, position and element, so a read that takes
a wrong head, token, block or byte shows in the result. Any TP sizes, head counts (split,
replicated, MLA), block sizes, layouts and block ids."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.vllm.layout import KVFormat, LayerLayout, RankLayout, compat_hash
from kvconnect.vllm.tpmap import (
    Span,
    block_pairs,
    check_mappable,
    head_range,
    layer_spans,
    segments,
    sources,
    with_heads,
)

CONTENT = 6  # int32 elements of one token of one head (K|V)
FORMAT = KVFormat("vllm 0.33.0", "m", "", "auto/float32", 16, 1, "FLASH_ATTN", "LBHNC")
EMPTY = -1


def tag(head: int, token: int, element: int) -> int:
    return (head * 100_000 + token) * 10 + element


@dataclass
class Side:
    """One TP rank's layer: a region of ``num_blocks`` blocks, logical (heads, tokens,
    content), HND (heads outer) or NHD (tokens outer), behind ``pad`` bytes; ``halves``: K/V
    halves (vLLM's CPU attention, HND only)."""

    tp_rank: int
    tp_size: int
    total_heads: int
    block_size: int
    hnd: bool
    num_blocks: int
    chunks: int = 1
    pad: int = 0
    halves: bool = False

    @property
    def heads(self) -> tuple[int, int]:
        return head_range(self.tp_rank, self.tp_size, self.total_heads)

    def layout(self) -> LayerLayout:
        count = self.heads[1]
        n, c = self.block_size, CONTENT
        strides = (n * c, c, 1) if self.hnd else (c, count * c, 1)
        block = count * n * c * 4
        plain = LayerLayout(
            name="layer",
            region=self.tp_rank,
            offset=self.pad,
            chunks=self.chunks,
            chunk_stride=self.num_blocks * block,
            num_blocks=self.num_blocks,
            block_stride=block,
            block_bytes=block,
            block_shape=(count, n, c),
            block_strides=strides,
            dtype="int32",
        )
        return with_heads(
            plain,
            self.tp_rank,
            self.tp_size,
            self.total_heads,
            self.block_size,
            kv_halves=self.halves,
        )

    def region(self) -> np.ndarray:
        layout = self.layout()
        return np.full(
            (layout.offset + self.chunks * layout.chunk_stride) // 4, EMPTY, dtype=np.int32
        )

    def places(self, chunk: int, block: int, head: int, token: int) -> list[int]:
        """Element indices in :meth:`region` of ``token``'s K and V of ``head``, in order."""
        layout = self.layout()
        sh, st_, _ = layout.block_strides
        at = layout.block_offset(chunk, block) // 4 + (head - self.heads[0]) * sh
        if not self.halves:
            return list(range(at + token * st_, at + token * st_ + CONTENT))
        half = CONTENT // 2  # all tokens' K, then all tokens' V
        keys = at + token * half
        values = at + (self.block_size + token) * half
        return [*range(keys, keys + half), *range(values, values + half)]


def fill(side: Side, blocks: list[int], region: np.ndarray) -> None:
    """Prompt token ``p`` lies in ``blocks[p // block_size]``: tag every row (chunk 1's tags
    are negated)."""
    first, count = side.heads
    for i, block in enumerate(blocks):
        for t in range(side.block_size):
            for head in range(first, first + count):
                for chunk in range(side.chunks):
                    sign = -1 if chunk else 1
                    position = i * side.block_size + t
                    region[side.places(chunk, block, head, t)] = [
                        sign * tag(head, position, e) for e in range(CONTENT)
                    ]


def apply(spans: list[Span], local: np.ndarray, remotes: dict[int, np.ndarray]) -> None:
    out = local.view(np.uint8)
    for span in spans:
        source = remotes[span.rank].view(np.uint8)
        out[span.local : span.local + span.length] = source[span.remote : span.remote + span.length]


@dataclass(frozen=True)
class Case:
    total: int  # KV heads of the model
    p_tp: int
    d_tp: int
    p_bs: int  # block sizes
    d_bs: int
    p_hnd: bool
    d_hnd: bool
    prompt: int
    had: int  # tokens decode had already (a multiple of its block size)
    chunks: int
    rank: int  # the decode rank that reads
    seed: int
    halves: bool  # both sides keep K/V halves (vLLM's CPU attention: HND only)


_TP = {total: [s for s in (1, 2, 4) if total % s == 0 or s % total == 0] for total in (1, 2, 4, 8)}


@st.composite
def cases(draw: st.DrawFn) -> Case:
    total = draw(st.sampled_from(sorted(_TP)))
    d_tp, d_bs = draw(st.sampled_from(_TP[total])), draw(st.sampled_from([1, 2, 4, 8]))
    prompt = draw(st.integers(1, 40))
    halves = draw(st.booleans())
    return Case(
        total=total,
        p_tp=draw(st.sampled_from(_TP[total])),
        d_tp=d_tp,
        p_bs=draw(st.sampled_from([1, 2, 4, 8])),
        d_bs=d_bs,
        p_hnd=halves or draw(st.booleans()),
        d_hnd=halves or draw(st.booleans()),
        prompt=prompt,
        had=draw(st.integers(0, (prompt - 1) // d_bs)) * d_bs,
        chunks=draw(st.sampled_from([1, 2])),
        rank=draw(st.integers(0, d_tp - 1)),
        seed=draw(st.integers(0, 2**16)),
        halves=halves,
    )


@settings(max_examples=300, deadline=None)
@given(cases())
def test_a_mapped_read_gives_each_local_row_its_heads_tokens_exactly_once(case: Case) -> None:
    total, p_tp, d_tp, p_bs, d_bs = case.total, case.p_tp, case.d_tp, case.p_bs, case.d_bs
    prompt, had, chunks, rank = case.prompt, case.had, case.chunks, case.rank
    rng = np.random.default_rng(case.seed)
    r_count = -(-prompt // p_bs)
    l_count = -(-(prompt - had) // d_bs)
    remote_blocks = [int(b) for b in rng.permutation(r_count + 3)[:r_count]]
    local_blocks = [int(b) for b in rng.permutation(l_count + 3)[:l_count]]
    prefill = {
        r: Side(r, p_tp, total, p_bs, case.p_hnd, r_count + 3, chunks, 8 * r, case.halves)
        for r in range(p_tp)
    }
    decode = Side(rank, d_tp, total, d_bs, case.d_hnd, l_count + 3, chunks, 12, case.halves)
    regions = {r: side.region() for r, side in prefill.items()}
    for r, side in prefill.items():
        fill(side, remote_blocks, regions[r])
    local = decode.region()
    layers = {r: side.layout() for r, side in prefill.items()}
    spans = layer_spans(decode.layout(), layers, local_blocks, remote_blocks, had, rank)
    apply(spans, local, regions)

    expected = np.full_like(local, EMPTY)
    end = min(had + l_count * d_bs, r_count * p_bs)
    first, count = decode.heads
    for i, block in enumerate(local_blocks):
        for t in range(d_bs):
            position = had + i * d_bs + t
            if position >= end:
                continue
            for head in range(first, first + count):
                for chunk in range(chunks):
                    sign = -1 if chunk else 1
                    expected[decode.places(chunk, block, head, t)] = [
                        sign * tag(head, position, e) for e in range(CONTENT)
                    ]
    np.testing.assert_array_equal(local, expected)
    rows = (end - had) * count * chunks
    assert sum(s.length for s in spans) == rows * CONTENT * 4, "each row read once"


def test_prefill_tp2_to_decode_tp1_reads_half_the_heads_from_each_rank() -> None:
    decode = Side(0, 1, 4, 16, True, 4).layout()
    prefill = {r: Side(r, 2, 4, 16, True, 4).layout() for r in range(2)}
    assert sources(decode, prefill, 0) == [(0, 0, 2), (1, 2, 2)]


def test_decode_tp2_reads_its_half_of_prefill_tp1s_heads() -> None:
    prefill = {0: Side(0, 1, 4, 16, True, 4).layout()}
    for rank, heads in ((0, (0, 2)), (1, (2, 2))):
        decode = Side(rank, 2, 4, 16, True, 4).layout()
        assert sources(decode, prefill, rank) == [(0, *heads)]


def test_a_replicated_head_or_latent_is_read_once_from_one_rank_spread_over_decode_ranks() -> None:
    # MLA (one latent on every rank), and GQA with 2 KV heads over 4 prefill ranks.
    latent = {r: Side(r, 2, 1, 16, False, 4).layout() for r in range(2)}
    assert sources(Side(0, 1, 1, 16, False, 4).layout(), latent, 0) == [(0, 0, 1)]
    gqa = {r: Side(r, 4, 2, 16, True, 4).layout() for r in range(4)}
    assert head_range(3, 4, 2) == (1, 1)
    picks = [sources(Side(r, 4, 2, 16, True, 4).layout(), gqa, r) for r in range(4)]
    assert picks == [[(0, 0, 1)], [(1, 0, 1)], [(2, 1, 1)], [(3, 1, 1)]]
    assert sources(Side(0, 1, 2, 16, True, 4).layout(), gqa, 0) == [(0, 0, 1), (2, 1, 1)]


def test_same_geometry_reads_whole_runs_of_blocks() -> None:
    side = Side(0, 1, 2, 4, False, 8)
    layout = side.layout()
    spans = layer_spans(layout, {0: layout}, [2, 3, 4, 7], [0, 1, 2, 5], 0, 0)
    block = layout.block_bytes
    assert spans == [Span(0, 2 * block, 0, 3 * block), Span(0, 7 * block, 5 * block, block)]


def test_segments_cut_where_a_block_ends_on_either_side() -> None:
    # decode had 4 tokens; its blocks of 4 from token 4, prefill's of 8 from token 0
    cuts = segments([10, 11], 4, [20, 21], 8, 4)
    assert [tuple(c) for c in cuts] == [(10, 0, 20, 4, 4), (11, 0, 21, 0, 4)]
    assert segments([10], 8, [20, 21, 22], 4, 8) == [(10, 0, 22, 0, 4)]


def test_block_pairs_skip_the_blocks_decode_had() -> None:
    assert block_pairs((7, 8, 9), (1, 2, 3, 4), 8, 4) == ((7, 8), (3, 4))
    assert block_pairs((7,), (1,), 0, 4) == ((7,), (1,))


def test_with_heads_leaves_layouts_it_cannot_read_unmapped() -> None:
    side = Side(1, 2, 4, 16, True, 4)
    layout = side.layout()
    assert (layout.first_head, layout.total_heads) == (2, 4)
    plain = msgspec.structs.replace(layout, first_head=0, total_heads=0)
    assert with_heads(plain, 1, 2, 0, 16).total_heads == 0, "heads unknown"
    assert with_heads(plain, 1, 2, 8, 16).total_heads == 0, "block holds 2 heads, not 4"
    assert with_heads(plain, 1, 2, 4, 32).total_heads == 0, "block holds 16 tokens, not 32"
    kv_first = msgspec.structs.replace(
        plain, block_shape=(16, 2, 3, 2), block_strides=(12, 6, 2, 1)
    )
    assert with_heads(kv_first, 1, 2, 4, 16).total_heads == 0
    nhd = Side(1, 2, 4, 16, False, 4).layout()
    assert with_heads(nhd, 1, 2, 4, 16, kv_halves=True).kv_halves is False, "halves need HND"
    assert with_heads(plain, 1, 2, 4, 16, kv_halves=True).kv_halves is True
    with pytest.raises(ValueError, match="split"):
        head_range(0, 4, 6)


def _rank(side: Side, **changes: object) -> RankLayout:
    fmt = msgspec.structs.replace(FORMAT, tp_size=side.tp_size, block_size=side.block_size)
    fmt = msgspec.structs.replace(fmt, **changes)
    layer = side.layout()
    return RankLayout(f"seg{side.tp_rank}", compat_hash(fmt, [layer]), (layer,), fmt)


def test_tp_block_size_and_layout_may_differ_but_not_what_the_bytes_are() -> None:
    decode = _rank(Side(0, 1, 4, 16, True, 4), kv_layout="LBNHC")
    prefill = {r: _rank(Side(r, 2, 4, 8, False, 4)) for r in range(2)}
    assert check_mappable(decode, prefill, strict=True) is None
    other_model = {r: _rank(Side(r, 2, 4, 8, False, 4), model="n") for r in range(2)}
    assert "model" in (check_mappable(decode, other_model, strict=True) or "")
    assert check_mappable(decode, other_model, strict=False) is None
    halves = {r: _rank(Side(r, 2, 4, 8, True, 4, halves=True)) for r in range(2)}
    assert "K/V halves" in (check_mappable(decode, halves, strict=False) or "")
    more_heads = {r: _rank(Side(r, 2, 8, 8, False, 4)) for r in range(2)}
    assert "KV heads: 8 at the peer, 4 here" in (
        check_mappable(decode, more_heads, strict=False) or ""
    )
    assert "not one TP group" in (check_mappable(decode, {1: prefill[1]}, strict=True) or "")
    unknown = RankLayout(
        "s",
        "",
        (msgspec.structs.replace(prefill[0].layers[0], total_heads=0),),
        prefill[0].format,
    )
    assert "unknown" in (check_mappable(decode, {0: unknown, 1: prefill[1]}, strict=True) or "")
