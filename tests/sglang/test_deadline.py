"""kvconnect's reads answer before SGLang's prefetch verdict, and stop when SGLang ends the
prefetch: SGLang's real controller, kvconnect's plugin hooks, a real cluster with one store
server stopped in the middle of a 128-page batch."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY

from kvconnect.sglang.deadline import PrefetchBudget
from kvconnect.sglang.metrics import RANK_LABELS
from kvconnect.sglang.plugin import DYNAMIC_ROUTE
from kvconnect.store.launch import Cluster, Process
from tests.sglang import harness as h

pytestmark = [
    pytest.mark.integration,
    pytest.mark.sglang,
    pytest.mark.usefixtures("plugins_loaded"),  # as in every SGLang process
]

PAGES, ON_A = 300, 200  # server A holds pages 0-199: batch 2 (pages 128-255) is split


@dataclass
class _Stored:
    cc: Any
    pool: Any
    tokens: list[int]
    pages: list[bytes]  # the bytes of each stored page
    slow: Process  # server B: pages 200-299


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster(servers=0, master_args=["--master-high-watermark", "1.0"]) as cluster:
        cluster.add_server("--store-size", str(ON_A * h.PAGE_BYTES))
        yield cluster


def _stored(cluster: Cluster, **budget: float) -> _Stored:
    """300 pages written through SGLang's controller (the ``dynamic`` route, with SGLang's
    prefetch settings in the extra-config as its PD path passes them): 0-199 on A, the rest on
    B. Over TCP: a stopped server serves nothing."""
    pool = h.mha_pool()
    extra = {
        **DYNAMIC_ROUTE,
        "master": cluster.master_endpoint,
        "transport": "tcp",
        "rpc_timeout": 0.5,
        **budget,
    }
    cc = h.controller(pool, "dynamic", extra, enable_storage_metrics=True)
    tokens = h.tokens_for(PAGES, seed=31)
    hashes = h.page_hashes(tokens)
    source = pool.alloc(len(tokens))
    h.fill(pool, source, seed=31)
    pages = h.pages_of(pool, source)
    split = ON_A * h.PAGE
    assert h.backup(cc, source[:split], tokens[:split], hashes[:ON_A]) == split
    slow = cluster.add_server("--store-size", str(32 << 20))
    assert h.backup(cc, source[split:], tokens[split:], hashes[ON_A:]) == len(tokens) - split
    assert sorted(s.objects for s in cluster.stats().segments) == [200, 400]
    pool.free(source)
    pool.kv_buffer.zero_()
    return _Stored(cc, pool, tokens, pages, slow)


@pytest.mark.parametrize("read_timeout", [None, 10.0], ids=["derived", "capped-above-budget"])
def test_the_read_answers_before_sglangs_timeout_with_the_pages_that_arrived(
    cluster: Cluster, read_timeout: float | None
) -> None:
    # SGLang's own default budget: 1 s + 0.25 s per 1024 requested tokens. A read_timeout
    # above it (once the only deadline) does not let the read outlive SGLang's verdict.
    settings = {"prefetch_timeout_base": 1.0, "prefetch_timeout_per_ki_token": 0.25}
    if read_timeout is not None:
        settings["read_timeout"] = read_timeout
    stored = _stored(cluster, **settings)
    cc = stored.cc
    try:
        assert cc.page_get_func.__wrapped__ == cc._page_get_zero_copy, "the plugin's hook"
        budget = PrefetchBudget.of(page_size=h.PAGE).seconds(PAGES)

        def sglang_timeout(operation: Any) -> bool:
            # SGLang's clock starts at the first blocked admission poll, after the creation:
            # a verdict at creation + budget is the earliest SGLang can give.
            return time.monotonic() > operation.start_time + budget

        stored.slow.signal(signal.SIGSTOP)
        try:
            result = h.prefetch(cc, "req-timed", stored.tokens, verdict=sglang_timeout)
        finally:
            stored.slow.signal(signal.SIGCONT)
        assert result.hit_tokens == PAGES * h.PAGE, "the master still lists every page"
        assert not result.terminated, "kvconnect answered before SGLang's verdict"
        assert result.completed_tokens == ON_A * h.PAGE, "with every page that arrived"
        assert h.pages_of(stored.pool, result.host_indices)[:ON_A] == stored.pages[:ON_A]
        assert cc.storage_backend.stats.pages_read == ON_A
        h.release(cc, result)
    finally:
        cc.detach_storage_backend()


def test_a_terminated_prefetch_stops_at_once_and_nothing_lands_after(cluster: Cluster) -> None:
    # A budget that never runs out here: only SGLang's termination can end the read early.
    stored = _stored(cluster, prefetch_timeout_base=600.0)
    cc, pool = stored.cc, stored.pool
    backend = cc.storage_backend
    try:

        def a_pages_in(operation: Any) -> bool:
            # Counted once the transfers completed: A's pages of batch 2 are in, B's are not.
            tcp = backend._client.engine.stats().transports.get("tcp")
            return tcp is not None and tcp.bytes_read >= ON_A * h.PAGE_BYTES

        canceled_before = _canceled_reads()
        stored.slow.signal(signal.SIGSTOP)
        try:
            result = h.prefetch(cc, "req-ended", stored.tokens, verdict=a_pages_in)
            # The final ack came while B is still stopped: kvconnect stopped when SGLang did.
            assert result.terminated
            assert result.read_tokens == ON_A * h.PAGE, "the leading pages that arrived"
            assert backend.stats.pages_canceled == 256 - ON_A, "batch 2's pages on B"
            assert _canceled_reads() - canceled_before == 1
            assert backend.stats.pages_withheld == 0, "the stopped server's reads were aborted"
            assert h.pages_of(pool, result.host_indices)[:ON_A] == stored.pages[:ON_A]
            h.release(cc, result)  # SGLang frees the slots; another request takes them
            probe = pool.alloc(10 * h.PAGE)
            other = pool.alloc(pool.available_size())
            h.fill(pool, other, seed=32)
            other_pages = h.pages_of(pool, other)
        finally:
            stored.slow.signal(signal.SIGCONT)
        # A read through the resumed server: a late answer to the ended read came before it.
        hashes = h.page_hashes(stored.tokens)[ON_A : ON_A + 10]
        assert backend.batch_get_v1(hashes, probe) == [True] * 10
        assert h.pages_of(pool, probe) == stored.pages[ON_A : ON_A + 10]
        assert h.pages_of(pool, other) == other_pages, "no byte landed in the freed slots"
        pool.free(torch.cat([probe, other]))
    finally:
        cc.detach_storage_backend()


def _canceled_reads() -> float:
    """``kvconnect_hicache_canceled_reads_total`` of this process's rank 0."""
    labels = dict.fromkeys(RANK_LABELS, "0")
    return REGISTRY.get_sample_value("kvconnect_hicache_canceled_reads_total", labels) or 0.0
