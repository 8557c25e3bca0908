"""The backend's page keys (no SGLang needed)."""

from __future__ import annotations

import pytest

from kvconnect.sglang.keys import PageFormat, SidecarFormat, page_keys, sidecar_keys


def _fmt(**changes: object) -> PageFormat:
    base: dict[str, object] = {
        "model": "Qwen/Qwen3-8B",
        "layout": "page_first",
        "dtype": "bfloat16",
        "page_size": 64,
        "mla": False,
    }
    return PageFormat(**{**base, **changes})  # type: ignore[arg-type]


def test_mha_pages_are_two_objects_per_rank_and_mla_pages_one_shared() -> None:
    rank0 = page_keys(_fmt(tp_rank=0, tp_size=2)).keys(["h1", "h2"])
    rank1 = page_keys(_fmt(tp_rank=1, tp_size=2)).keys(["h1", "h2"])
    assert len(rank0) == 4
    assert rank0[0].endswith("/k")
    assert rank0[1].endswith("/v")
    assert not set(rank0) & set(rank1), "MHA ranks hold different heads: separate keys"
    mla0 = page_keys(_fmt(mla=True, tp_rank=0, tp_size=2)).keys(["h1"])
    mla1 = page_keys(_fmt(mla=True, tp_rank=1, tp_size=2)).keys(["h1"])
    assert mla0 == mla1, "MLA pages are the same on every rank"
    assert len(mla0) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"layout": "page_first_direct"},
        {"dtype": "float16"},
        {"page_size": 32},
        {"model": "other"},
        {"tp_size": 4},
        {"namespace": "tenant-b"},
        {"pp_rank": 1, "pp_size": 2},
        {"dcp_rank": 1, "dcp_size": 2},
    ],
)
def test_anything_that_changes_the_bytes_changes_the_key(change: dict[str, object]) -> None:
    assert page_keys(_fmt()).keys(["h"]) != page_keys(_fmt(**change)).keys(["h"])


def test_leading_pages_needs_every_object_of_a_page() -> None:
    mha = page_keys(_fmt())
    assert mha.leading_pages([True, True, True, False, True, True]) == 1
    assert mha.leading_pages([True, True] * 3) == 3
    assert mha.leading_pages([False, True]) == 0
    assert page_keys(_fmt(mla=True)).leading_pages([True, True, False]) == 2


def test_page_head_shards_are_named_by_their_heads_not_by_the_rank() -> None:
    def keys(tp_rank: int, tp_size: int, hashes: list[str]) -> list[str]:
        fmt = _fmt(layout="page_head", tp_rank=tp_rank, tp_size=tp_size, tp_lcm_size=2)
        return page_keys(fmt).keys(hashes)

    tp1 = keys(0, 1, ["h1", "h2"])
    assert len(tp1) == 8, "a TP-1 page is two shards of K and V"
    assert tp1[:4] == keys(0, 2, ["h1"]) + keys(1, 2, ["h1"]), "shards in head order"
    assert page_keys(_fmt(layout="page_head", tp_rank=1, tp_size=2)).keys(["h"]) == keys(
        1, 2, ["h"]
    ), "tp_lcm_size equal to tp_size changes nothing"


def test_tp_lcm_size_splits_only_page_head_mha_pages() -> None:
    assert _fmt(layout="page_head", tp_size=1, tp_lcm_size=4).head_split == 4
    assert _fmt(layout="page_head", tp_size=2, tp_lcm_size=4).head_split == 2
    assert _fmt(layout="page_head", tp_size=2).head_split == 1
    assert _fmt(tp_size=1, tp_lcm_size=4).head_split == 1, "page_first: heads stay together"
    mla = _fmt(layout="page_head", mla=True, tp_lcm_size=4)
    assert mla.head_split == 1
    assert page_keys(mla).objects == 1


def test_keys_of_different_pools_and_ranks_never_collide() -> None:
    # Every pool kind SGLang's hybrid assembler builds, on two TP ranks of an MHA and an MLA
    # model, with the KV pages' own keys: no two objects share a key, except the shared
    # (MLA-shaped) pools' and MLA KV's, which are one object for every rank by design.
    pools = ["swa", "mamba", "indexer", "draft", "draft_swa", "draft_indexer"]
    owners: dict[str, set[tuple[object, ...]]] = {}
    for mla in (False, True):
        for rank in (0, 1):
            fmt = _fmt(model=f"model-{mla}", mla=mla, tp_rank=rank, tp_size=2)
            for key in page_keys(fmt).keys(["h1", "h2"]):
                owners.setdefault(key, set()).add(("kv", mla, rank if not mla else None))
            for name in pools:
                shared = mla and name != "mamba"
                pool = SidecarFormat(name, "page_first", "bfloat16", objects=3, shared=shared)
                for key in sidecar_keys(fmt, pool).keys(["h1", "h2"]):
                    owners.setdefault(key, set()).add((name, mla, None if shared else rank))
    assert all(len(owner) == 1 for owner in owners.values())
    kv = 2 * 2 * 2 + 2  # MHA: K and V per page and rank; MLA: one per page
    mha_pools = 6 * 2 * 2 * 3  # pools x ranks x pages x objects
    mla_pools = 2 * 2 * 3 + 5 * 2 * 3  # the Mamba state per rank, the others shared
    assert len(owners) == kv + mha_pools + mla_pools
    # the pool's format is in its keys too
    fmt = _fmt()
    base = SidecarFormat("swa", "page_first", "bfloat16", objects=2, shared=False)
    other = SidecarFormat("swa", "page_first", "float16", objects=2, shared=False)
    assert not set(sidecar_keys(fmt, base).keys(["h"])) & set(sidecar_keys(fmt, other).keys(["h"]))
