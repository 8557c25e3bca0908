"""The backend's page keys (no SGLang needed)."""

from __future__ import annotations

import pytest

from kvconnect.sglang.keys import PageFormat, page_keys


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
