"""Pool lookups off vLLM's scheduler thread (kvconnect/vllm/lookup.py), every environment: an
answer never waits for the store, results are kept per request and computed-token count, a
failed lookup is a miss, and the number of requests kept is bounded."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from kvconnect.vllm.lookup import PoolLookups
from kvconnect.vllm.pool import Verdict
from tests.support.waiting import wait_for


class _Index:
    """A StorePoolIndex stand-in whose lookups block until the test opens its gate."""

    keys = None
    verdict = Verdict.AGREE

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.asked: list[tuple[str, ...]] = []

    def leading(self, hashes: Sequence[str], first: int) -> int:
        self.asked.append(tuple(hashes))
        self.gate.wait(10)
        if hashes and hashes[0] == "boom":
            raise RuntimeError("a bug in the lookup")
        return len(hashes) - 1


@pytest.fixture
def index() -> _Index:
    return _Index()


@pytest.fixture
def lookups(index: _Index) -> Iterator[PoolLookups]:
    pool = PoolLookups(index, limit=3)  # type: ignore[arg-type]
    yield pool
    index.gate.set()
    pool.close()


def _answered(lookups: PoolLookups, *args: Any) -> int:
    wait_for(lambda: not lookups.busy(), "the lookup did not finish")
    answer = lookups.ask(*args)
    assert answer is not None
    return answer


def test_an_answer_never_waits_for_the_store_and_is_kept_per_computed_count(
    index: _Index, lookups: PoolLookups
) -> None:
    assert lookups.ask("r", 0, ["a", "b", "c"]) is None, "answered before the lookup ran"
    assert lookups.ask("r", 0, ["a", "b", "c"]) is None, "still running: asked once"
    assert lookups.ask("s", 0, ["x", "y"]) is None, "a second request waits for nothing"
    index.gate.set()
    assert _answered(lookups, "r", 0, ["a", "b", "c"]) == 2
    assert _answered(lookups, "s", 0, ["x", "y"]) == 1
    assert index.asked == [("a", "b", "c"), ("x", "y")], "a kept result is not asked again"
    assert lookups.ask("r", 16, ["b", "c"]) is None, "a new computed count is a new lookup"
    assert _answered(lookups, "r", 16, ["b", "c"]) == 1
    lookups.forget("r")
    assert lookups.ask("r", 16, ["b", "c"]) is None, "forgotten"


def test_a_failed_lookup_is_a_miss_and_past_the_limit_a_request_misses_at_once(
    index: _Index, lookups: PoolLookups, caplog: pytest.LogCaptureFixture
) -> None:
    index.gate.set()
    assert lookups.ask("bad", 0, ["boom", "x"]) is None
    assert _answered(lookups, "bad", 0, ["boom", "x"]) == 0
    assert "pool lookup of bad failed" in caplog.text
    for rid in ("b", "c"):
        assert lookups.ask(rid, 0, ["a", "b"]) is None
    assert lookups.ask("d", 0, ["a", "b"]) == 0, "a fourth request kept past the limit"
    lookups.forget("b")
    assert lookups.ask("d", 0, ["a", "b"]) is None


def test_saves_wait_for_the_keys_and_the_fleet_probe(index: _Index, lookups: PoolLookups) -> None:
    assert not lookups.usable, "no key scheme yet"
    index.keys = object()  # type: ignore[assignment]
    assert lookups.usable
    index.verdict = Verdict.DIFFER
    assert not lookups.usable
