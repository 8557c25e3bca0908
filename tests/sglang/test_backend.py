"""The backend under SGLang's real HiCache controller, against a real kvconnect cluster.

Master and store servers run as separate processes; SGLang's controller runs its own backup,
prefetch and ack threads in this process over real host KV pools.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvconnect.store import messages as m
from kvconnect.store.launch import Cluster
from tests.sglang import harness as h
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.sglang]

FAST = {"rpc_timeout": 0.5, "breaker_cooldown": 0.5}


def _extra(cluster: Cluster, **settings: Any) -> dict[str, Any]:
    return {"master": cluster.master_endpoint, **FAST, **settings}


def _dynamic(cluster: Cluster, **settings: Any) -> dict[str, Any]:
    """The no-patch route: SGLang's ``dynamic`` loader with the zero-copy interface."""
    return h.dynamic(_extra(cluster, **settings))


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster(servers=2, server_size=32 << 20, master_args=["--master-heartbeat-ttl", "3"]) as c:
        yield c


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_pages_written_through_come_back_byte_identical(cluster: Cluster, layout: str) -> None:
    pool = h.mha_pool(layout)
    cc = h.controller(pool, "dynamic", _dynamic(cluster))
    try:
        assert cc.page_get_func.__name__ == "_page_get_zero_copy"
        backend = cc.storage_backend
        tokens = h.tokens_for(300)
        source = pool.alloc(len(tokens))
        h.fill(pool, source, seed=1)
        expected = h.pages_of(pool, source)
        assert h.backup(cc, source, tokens) == len(tokens)
        assert backend.stats.pages_written == 300
        # the pages are in the store, under kvconnect's keys
        assert _stored_keys(cluster) == 600  # K and V objects of 300 pages
        pool.free(source)
        pool.kv_buffer.zero_()  # L1/L2 dropped: only L3 has the pages now
        result = h.prefetch(cc, "req-1", tokens)
        assert result.hit_tokens == len(tokens)
        assert result.completed_tokens == len(tokens)
        assert h.pages_of(pool, result.host_indices) == expected
        assert backend.stats.pages_read == 300
        h.release(cc, result)
        # written again: nothing new is stored (pages already there are skipped)
        again = pool.alloc(len(tokens))
        assert h.backup(cc, again, tokens) == len(tokens)
        assert _stored_keys(cluster) == 600
        pool.free(again)
    finally:
        cc.detach_storage_backend()


def test_a_slow_store_gives_the_leading_pages_by_the_deadline() -> None:
    # Server A holds exactly the first 128 pages (full, and never evicting); the rest go to
    # server B, which then stops. Over TCP: a stopped process serves nothing (same-host
    # shared memory would not need it).
    with Cluster(servers=0, master_args=["--master-high-watermark", "1.0"]) as cluster:
        cluster.add_server("--store-size", str(128 * h.PAGE_BYTES))
        _leading_pages_by_the_deadline(cluster)


def _leading_pages_by_the_deadline(cluster: Cluster) -> None:
    read_timeout = 1.0
    pool = h.mha_pool()
    settings = {"transport": "tcp", "read_timeout": read_timeout, "negative_ttl": 30}
    cc = h.controller(pool, "dynamic", _dynamic(cluster, **settings))
    try:
        tokens = h.tokens_for(300)
        hashes = h.page_hashes(tokens)
        source = pool.alloc(len(tokens))
        h.fill(pool, source, seed=2)
        expected = h.pages_of(pool, source)
        first = 128 * h.PAGE
        assert h.backup(cc, source[:first], tokens[:first], hashes[:128]) == first
        slow = cluster.add_server("--store-size", str(32 << 20))
        assert h.backup(cc, source[first:], tokens[first:], hashes[128:]) == len(tokens) - first
        assert [s.objects for s in _segments(cluster)] == [256, 344], "A: pages 0-127, B: rest"
        pool.free(source)
        pool.kv_buffer.zero_()
        slow.signal(signal.SIGSTOP)
        try:
            result = h.prefetch(cc, "req-slow", tokens)
        finally:
            slow.signal(signal.SIGCONT)
        assert result.hit_tokens == len(tokens), "the master still lists every page"
        assert result.completed_tokens == first, "the pages that arrived: a leading prefix"
        assert read_timeout * 0.9 <= result.seconds < read_timeout + 3.0
        assert h.pages_of(pool, result.host_indices)[:128] == expected[:128]
        h.release(cc, result)
        # the pages that timed out are reported absent for a while: no second wait on them
        again = h.prefetch(cc, "req-again", tokens)
        assert again.hit_tokens == first
        assert again.completed_tokens == first
        assert again.seconds < read_timeout
        h.release(cc, again)
    finally:
        cc.detach_storage_backend()


def test_a_dead_store_means_local_only_until_it_returns(cluster: Cluster) -> None:
    pool = h.mha_pool()
    cc = h.controller(pool, "dynamic", _dynamic(cluster, breaker_cooldown=3.0))
    backend = cc.storage_backend
    try:
        tokens = h.tokens_for(40)
        source = pool.alloc(len(tokens))
        h.fill(pool, source, seed=3)
        assert h.backup(cc, source, tokens) == len(tokens)
        wait_for(lambda: _backlog(cluster) == 0, "store servers did not learn their objects")
        cluster.master.kill()
        # local-only: lookups say 0 pages, writes are skipped, quickly
        start = time.monotonic()
        assert h.prefetch(cc, "req-down", tokens).hit_tokens == 0
        other = h.tokens_for(10, seed=1)
        assert h.backup(cc, source[: len(other)], other) == 0
        assert time.monotonic() - start < 5.0
        backend.batch_exists(h.page_hashes(tokens))  # the failures open the breaker
        assert backend.local_only
        for _ in range(3):  # within the cool-down no call reaches the store: no probe either
            assert backend.batch_exists(h.page_hashes(tokens)) == 0
            assert backend.breaker_state == "open"
        cluster.restart_master()  # store servers report what they hold to the new master
        wait_for(lambda: backend.batch_exists(h.page_hashes(tokens)) == 40, "no recovery", 20)
        pool.kv_buffer.zero_()
        result = h.prefetch(cc, "req-up", tokens)
        assert result.completed_tokens == len(tokens)
        h.release(cc, result)
        assert backend.stats.errors == 0, "store trouble is not an unexpected error"
    finally:
        cc.detach_storage_backend()


def _stored_keys(cluster: Cluster) -> int:
    return cluster.stats().keys


def _segments(cluster: Cluster) -> list[m.SegmentStats]:
    return sorted(cluster.stats().segments, key=lambda s: s.capacity)


def _backlog(cluster: Cluster) -> int:
    return sum(s.backlog for s in cluster.stats().segments)


def test_an_unexpected_error_is_a_miss_and_sglang_threads_live_on(cluster: Cluster) -> None:
    pool = h.mha_pool()
    cc = h.controller(pool, "dynamic", _dynamic(cluster))
    backend = cc.storage_backend
    try:
        tokens = h.tokens_for(12, seed=5)
        source = pool.alloc(len(tokens))
        h.fill(pool, source, seed=5)
        expected = h.pages_of(pool, source)
        assert h.backup(cc, source, tokens) == len(tokens)
        pool.free(source)
        memory = backend._memory
        original = memory.locate

        def broken(host_indices: Any) -> Any:
            raise ValueError("a bug in page addressing")

        memory.locate = broken  # every read now fails inside the backend
        failed = h.prefetch(cc, "req-broken", tokens)
        assert failed.hit_tokens == len(tokens)
        assert failed.completed_tokens == 0, "reported as a miss: SGLang recomputes"
        assert backend.stats.errors == 1
        h.release(cc, failed)
        memory.locate = original
        pool.kv_buffer.zero_()
        result = h.prefetch(cc, "req-after", tokens)  # the prefetch thread is still there
        assert h.pages_of(pool, result.host_indices) == expected
        h.release(cc, result)
    finally:
        cc.detach_storage_backend()


def test_a_read_that_cannot_be_stopped_keeps_its_host_pages_from_reuse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Server A holds exactly pages 0-4 (full, never evicting), server B pages 5-7; the copies
    # from B are held past the deadline and the settle grace, those from A are not.
    with Cluster(servers=0, master_args=["--master-high-watermark", "1.0"]) as cluster:
        cluster.add_server("--store-size", str(5 * h.PAGE_BYTES))
        pool = h.mha_pool(pages=40)
        cc = h.controller(pool, "dynamic", _dynamic(cluster, read_timeout=1.0))
        held = h.HeldCopies(monkeypatch)
        try:
            _late_read_lands_only_in_withheld_pages(cluster, cc, pool, held)
        finally:
            held.let_go.set()
            cc.detach_storage_backend()


def _late_read_lands_only_in_withheld_pages(
    cluster: Cluster, cc: Any, pool: Any, held: h.HeldCopies
) -> None:
    tokens = h.tokens_for(8, seed=21)
    hashes = h.page_hashes(tokens)
    source = pool.alloc(len(tokens))
    h.fill(pool, source, seed=21)
    stored = h.pages_of(pool, source)
    first = 5 * h.PAGE
    assert h.backup(cc, source[:first], tokens[:first], hashes[:5]) == first
    cluster.add_server("--store-size", str(32 << 20))
    assert h.backup(cc, source[first:], tokens[first:], hashes[5:]) == len(tokens) - first
    assert [s.objects for s in _segments(cluster)] == [10, 6], "A: pages 0-4, B: 5-7"
    pool.free(source)
    pool.kv_buffer.zero_()
    late: list[torch.Tensor] = []

    def hold_pages_from_b(slots: torch.Tensor) -> None:
        late.append(slots[first:])
        held.hold_pages(pool, slots[first:])

    result = h.prefetch(cc, "req-late", tokens, before_read=hold_pages_from_b)
    assert held.blocked.is_set()
    assert result.completed_tokens == first, "pages 0-4 arrived and are used"
    assert h.pages_of(pool, result.host_indices)[:5] == stored[:5]
    assert cc.storage_backend.stats.pages_withheld == 3
    h.release(cc, result)  # the prefetch is done with its slots: all 8 are freed
    # another request takes every free slot: it gets all but exactly the stuck pages' slots
    other = pool.alloc(pool.available_size())
    assert len(other) == (40 - 3) * h.PAGE
    assert not set(other.tolist()) & set(late[0].tolist())
    h.fill(pool, other, seed=22)
    other_bytes = h.pages_of(pool, other)
    held.let_go.set()  # the late write lands ...
    wait_for(lambda: pool.available_size() == 3 * h.PAGE, "withheld slots never came back")
    assert h.pages_of(pool, other) == other_bytes, "... never in another request's KV"
    assert h.pages_of(pool, late[0]) == stored[5:], "it did land: in the withheld pages"
    again = pool.alloc(3 * h.PAGE)  # settled: SGLang can use them again
    assert sorted(again.tolist()) == sorted(late[0].tolist())
    pool.free(again)
    pool.free(other)


def test_a_write_that_cannot_be_stopped_keeps_its_source_pages_from_reuse(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = h.mha_pool(pages=40)
    cc = h.controller(pool, "dynamic", _dynamic(cluster, write_timeout=1.0))
    backend = cc.storage_backend
    held = h.HeldCopies(monkeypatch)
    try:
        tokens = h.tokens_for(4, seed=23)
        source = pool.alloc(len(tokens))
        h.fill(pool, source, seed=23)
        held.hold_pages(pool, source)
        assert h.backup(cc, source, tokens) == 0, "the batch did not complete"
        assert backend.stats.pages_withheld == 4
        pool.free(source)  # SGLang evicts the pages from host memory ...
        pool.clear()  # ... or flushes the whole host cache
        other = pool.alloc(pool.available_size())
        assert len(other) == (40 - 4) * h.PAGE
        assert not set(other.tolist()) & set(source.tolist()), "a transport still reads them"
        held.let_go.set()
        wait_for(lambda: pool.available_size() == 4 * h.PAGE, "withheld slots never came back")
        again = pool.alloc(4 * h.PAGE)
        assert sorted(again.tolist()) == sorted(source.tolist())
    finally:
        held.let_go.set()
        cc.detach_storage_backend()
