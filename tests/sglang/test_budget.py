"""The prefetch budget and the read deadline derived from it (kvconnect/sglang/deadline.py)."""

from __future__ import annotations

import pytest

from kvconnect.sglang.deadline import (
    Operation,
    PrefetchBudget,
    PrefetchPolicy,
    read_deadline,
)

# SGLang's defaults at 256-token pages: 1 s + 1/16 s per page.
DEFAULT = PrefetchBudget.of(page_size=256)


def test_the_budget_is_sglangs_formula() -> None:
    assert PrefetchBudget(PrefetchPolicy.TIMEOUT, 1.0, 0.0625) == DEFAULT
    assert DEFAULT.seconds(128) == 9.0  # 32768 tokens: 1 s + 32 x 0.25 s
    custom = PrefetchBudget.of("wait_complete", 2, 0.5, page_size=16)
    assert custom.policy is PrefetchPolicy.WAIT_COMPLETE
    assert custom.seconds(64) == 2.5  # 1024 tokens
    with pytest.raises(ValueError, match="sometimes"):
        PrefetchBudget.of("sometimes", page_size=16)


def test_every_batch_of_a_timed_prefetch_ends_before_sglangs_verdict() -> None:
    operation = Operation(start=100.0, pages=300)  # SGLang: 1 + 300/16 = 19.75 s
    first = read_deadline(DEFAULT, 100.5, 128, operation=operation, margin=0.25, cap=None)
    later = read_deadline(DEFAULT, 110.0, 44, operation=operation, margin=0.25, cap=None)
    assert first == later == 100.0 + 19.75 - 0.25


def test_a_refetch_ends_by_the_clock_sglang_started_for_the_first_attempt() -> None:
    # The request's wait began before this operation: SGLang's verdict comes first.
    refetch = Operation(start=110.0, pages=300, verdict=115.0)
    assert read_deadline(DEFAULT, 110.0, 128, operation=refetch, margin=0.25, cap=None) == 114.75
    # A clock started after the creation changes nothing: the creation's end is earlier.
    first = Operation(start=100.0, pages=300, verdict=125.0)
    assert read_deadline(DEFAULT, 100.0, 128, operation=first, margin=0.25, cap=None) == 119.5


def test_without_a_verdict_to_beat_each_read_gets_the_budget_of_its_pages() -> None:
    operation = Operation(start=100.0, pages=300)
    for policy in (PrefetchPolicy.WAIT_COMPLETE, PrefetchPolicy.BEST_EFFORT):
        budget = PrefetchBudget(policy, 1.0, 0.0625)
        assert read_deadline(budget, 150.0, 16, operation=operation, margin=0.25, cap=None) == 152.0
    # the operation unknown (no plugin): the same per-read bound, less the margin under the
    # timeout policy (SGLang's clock started before this read)
    assert read_deadline(DEFAULT, 150.0, 16, operation=None, margin=0.25, cap=None) == 151.75


def test_read_timeout_caps_and_the_margin_never_eats_a_small_budget() -> None:
    operation = Operation(start=100.0, pages=300)
    assert read_deadline(DEFAULT, 101.0, 128, operation=operation, margin=0.25, cap=2.0) == 103.0
    assert read_deadline(DEFAULT, 101.0, 16, operation=None, margin=0.25, cap=5.0) == 102.75
    tiny = PrefetchBudget(PrefetchPolicy.TIMEOUT, 0.2, 0.0)
    small = Operation(start=100.0, pages=4)
    assert read_deadline(tiny, 100.0, 4, operation=small, margin=0.25, cap=None) == pytest.approx(
        100.15
    )


def test_a_deadline_already_passed_is_now() -> None:
    operation = Operation(start=100.0, pages=16)  # SGLang: 2 s
    assert read_deadline(DEFAULT, 130.0, 16, operation=operation, margin=0.25, cap=None) == 130.0
