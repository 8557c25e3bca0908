"""kvconnect as L3 under SGLang's real ``UnifiedRadixCache`` (HiCache), on a real cluster.

Two SGLang instances share one kvconnect store (a master and store servers in their own
processes): a writer whose write policy backs its KV up to L3, and a reader that prefetches it
under a prefetch policy; the reader's host pages must hold the writer's device bytes.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from kvconnect.store.launch import Cluster
from tests.sglang import harness as h
from tests.sglang import radix as r
from tests.support import leaks
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.sglang,
    pytest.mark.usefixtures("plugins_loaded"),  # as in every SGLang process
]


FAST = {
    "rpc_timeout": 0.5,
    "breaker_cooldown": 0.5,
    "transport": "tcp",
    "transfer": {"connect_timeout": 1.0},
}
"""Short kvconnect timeouts; TCP to the store servers (a stopped server then serves nothing:
same-host shared memory would not need it). A connection being set up to a stopped server
delays closing the client by up to ``connect_timeout``."""
PAGES = 12
LEADING = 5  # pages of the stalled batch on the server that answers


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster(servers=1, server_size=16 << 20) as c:
        yield c


def _extra(cluster: Cluster, **settings: Any) -> dict[str, Any]:
    return {"master": cluster.master_endpoint, **FAST, **settings}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return tmp_path / "model"


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_a_waiting_policy_admits_once_every_page_landed(
    cluster: Cluster, model_dir: Path, policy: str
) -> None:
    args = r.args(model_dir, _extra(cluster, prefetch_threshold=h.PAGE), prefetch_policy=policy)
    with r.scheduler(args), r.Engine(args) as writer, r.Engine(args) as reader:
        tokens = h.tokens_for(PAGES)
        written = writer.insert(tokens, seed=1)
        writer.settle_backups()
        assert cluster.stats().keys == 2 * PAGES  # K and V of each page
        assert reader.host_hit(tokens) == 0
        handle = reader.run_prefetch("req-1", tokens)
        assert reader.host_hit(tokens) == len(tokens)
        assert reader.landed(handle, tokens) == written
        assert reader.backend.stats.pages_read == PAGES


def test_best_effort_admits_at_once_with_what_landed(cluster: Cluster, model_dir: Path) -> None:
    args = r.args(
        model_dir, _extra(cluster, prefetch_threshold=h.PAGE), prefetch_policy="best_effort"
    )
    with r.scheduler(args), r.Engine(args) as writer, r.Engine(args) as reader:
        early, late = h.tokens_for(PAGES, seed=1), h.tokens_for(PAGES, seed=2)
        written = {1: writer.insert(early, seed=1), 2: writer.insert(late, seed=2)}
        writer.settle_backups()
        # polled at once: admitted on the first poll, with the leading pages that had landed
        handle = reader.prefetch("req-early", early)
        assert reader.poll(handle)
        landed = reader.landed(handle, early)
        assert landed == written[1][: len(landed)]
        # polled after the reads finished: every page is in the tree
        handle = reader.prefetch("req-late", late)
        reader.pump(lambda: reader.operation(handle) is None, "the prefetch never finished")
        assert reader.poll(handle)
        assert reader.host_hit(late) == len(late)
        assert reader.landed(handle, late) == written[2]


def test_prefetch_threshold(cluster: Cluster, model_dir: Path) -> None:
    threshold = 8 * h.PAGE
    args = r.args(model_dir, _extra(cluster, prefetch_threshold=threshold))
    with r.scheduler(args), r.Engine(args) as writer, r.Engine(args) as reader:
        short, enough = h.tokens_for(7, seed=1), h.tokens_for(8, seed=2)
        writer.insert(short, seed=1)
        written = writer.insert(enough, seed=2)
        writer.settle_backups()
        assert cluster.stats().keys == 2 * 15
        # below the threshold: no prefetch, nothing read (SGLang declines before any lookup)
        handle = reader.prefetch("req-short", short)
        assert reader.operation(handle) is None
        assert reader.poll(handle)
        assert reader.host_hit(short) == 0
        assert reader.cache.prefetch_outcome_stats_snapshot()["declined_too_short"] == 1
        # at the threshold: prefetched
        handle = reader.run_prefetch("req-enough", enough)
        assert reader.host_hit(enough) == threshold
        assert reader.landed(handle, enough) == written
        assert reader.backend.stats.pages_read == 8


def test_a_stalled_server_mid_batch_gives_exactly_the_leading_pages(model_dir: Path) -> None:
    # One batch (< 128 pages) whose pages 0..LEADING-1 live on server A and the rest on
    # server B: A is sized for exactly LEADING pages (full, never evicting), B joins after
    # they were written.
    with Cluster(servers=0, master_args=["--master-high-watermark", "1.0"]) as cluster:
        cluster.add_server("--store-size", str(LEADING * h.PAGE_BYTES))
        # SGLang's default budget: kvconnect's derived deadline answers before its verdict
        extra = _extra(cluster, negative_ttl=0)
        args = r.args(model_dir, {**extra, "prefetch_threshold": h.PAGE})
        with r.scheduler(args), r.Engine(args) as writer, r.Engine(args) as reader:
            _partial_reuse(cluster, writer, reader)


def _partial_reuse(cluster: Cluster, writer: r.Engine, reader: r.Engine) -> None:
    tokens = h.tokens_for(PAGES)
    leading = LEADING * h.PAGE
    writer.insert(tokens[:leading], seed=3)
    writer.settle_backups()
    slow = cluster.add_server("--store-size", str(16 << 20))
    written = writer.insert(tokens, seed=3)
    writer.settle_backups()
    objects = [s.objects for s in sorted(cluster.stats().segments, key=lambda s: s.capacity)]
    assert objects == [2 * LEADING, 2 * (PAGES - LEADING)], "A: the leading pages, B: the rest"
    slow.signal(signal.SIGSTOP)
    try:
        handle = reader.run_prefetch("req-stalled", tokens)
        assert reader.host_hit(tokens) == leading, "exactly the leading pages are in the tree"
        assert reader.landed(handle, tokens) == written[:LEADING]
        tail = reader.slots(handle)[leading:]
        # the tail's slots went back to the pool (over TCP the late read is cancelled, not
        # withheld): take every free slot for other requests' KV, with a sentinel in it
        pool = reader.host_pool
        taken = pool.alloc(pool.available_size())
        assert bool(torch.isin(tail, taken).all()), "the tail's slots were not freed"
        assert reader.backend.stats.pages_withheld == 0
        expected = r.sentinel(pool, taken)
    finally:
        slow.signal(signal.SIGCONT)
    # B answers the stalled read now. The same connection serves a later read: once that one
    # is done, whatever B still sent for the first has been dealt with.
    is_tail = torch.isin(taken, tail)
    others = taken[~is_tail]
    barrier, kept = others[: PAGES * h.PAGE], torch.cat([taken[is_tail], others[PAGES * h.PAGE :]])
    pool.free(barrier)
    again = reader.run_prefetch("req-again", tokens)
    assert reader.host_hit(tokens) == len(tokens), "the rest is read later"
    assert reader.landed(again, tokens) == written
    assert r.page_bytes(pool, kept) == expected[: len(kept) // h.PAGE * h.PAGE_BYTES]
    pool.free(kept)


def test_a_stalled_read_blocks_neither_the_scheduler_nor_other_lookups(model_dir: Path) -> None:
    # request 1's pages on server B (stopped), request 2's on server A
    with Cluster(servers=0, master_args=["--master-high-watermark", "1.0"]) as cluster:
        cluster.add_server("--store-size", str(PAGES * h.PAGE_BYTES))
        # the stall ends by SIGCONT, long before either deadline
        extra = _extra(cluster, read_timeout=60.0, prefetch_timeout_base=120)
        args = r.args(model_dir, {**extra, "prefetch_threshold": h.PAGE})
        with r.scheduler(args), r.Engine(args) as writer, r.Engine(args) as reader:
            _overlap(cluster, writer, reader)


def _overlap(cluster: Cluster, writer: r.Engine, reader: r.Engine) -> None:
    first, second = h.tokens_for(PAGES, seed=1), h.tokens_for(PAGES, seed=2)
    written = {2: writer.insert(second, seed=2)}
    writer.settle_backups()
    slow = cluster.add_server("--store-size", str(16 << 20))
    written[1] = writer.insert(first, seed=1)
    writer.settle_backups()
    slow.signal(signal.SIGSTOP)
    try:
        stalled = reader.prefetch("req-stalled", first)
        operation = reader.operation(stalled)
        # the IO thread has taken the read (host slots given, queue empty): it is in kvconnect
        reader.pump(
            lambda: (
                operation.host_indices is not None and reader.controller.prefetch_buffer.empty()
            ),
            "the stalled prefetch never started reading",
        )
        # meanwhile the scheduler thread runs rounds; admission polls return (not admitted),
        # and another request's lookup is answered and its host slots are given
        other = reader.prefetch("req-other", second)
        other_operation = reader.operation(other)
        reader.pump(
            lambda: not reader.poll(stalled) and other_operation.host_indices is not None,
            "the other request's lookup waited for the stalled read",
        )
        assert other_operation.storage_hit_count == len(second)
        assert reader.operation(stalled) is operation, "the stalled read is still in flight"
        assert operation.completed_tokens == 0
        assert reader.backend.stats.pages_read == 0
    finally:
        slow.signal(signal.SIGCONT)
    reader.pump(lambda: reader.poll(stalled) and reader.poll(other), "prefetches never ended")
    assert reader.landed(stalled, first) == written[1]
    assert reader.landed(other, second) == written[2]


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_each_write_policy_backs_pages_up_to_the_store(
    cluster: Cluster, model_dir: Path, policy: str
) -> None:
    args = r.args(model_dir, _extra(cluster, prefetch_threshold=h.PAGE), write_policy=policy)
    with r.scheduler(args), r.Engine(args) as writer, r.Engine(args) as reader:
        tokens = h.tokens_for(PAGES)
        written = writer.insert(tokens, seed=4)
        writer.settle_backups()
        if policy == "write_through_selective":
            assert cluster.stats().keys == 0, "backed up on the second hit only"
            assert writer.insert(tokens, seed=4) == written  # the prefix is hit again
        elif policy == "write_back":
            assert cluster.stats().keys == 0, "backed up on eviction only"
            writer.evict_device()
        writer.settle_backups()
        assert cluster.stats().keys == 2 * PAGES
        assert writer.backend.stats.pages_written == PAGES
        handle = reader.run_prefetch("req-1", tokens)
        assert reader.host_hit(tokens) == len(tokens)
        assert reader.landed(handle, tokens) == written


def test_detach_with_a_read_in_flight_then_attach_again(cluster: Cluster, model_dir: Path) -> None:
    extra = _extra(cluster, prefetch_threshold=h.PAGE)
    args = r.args(model_dir, extra)
    tokens = h.tokens_for(PAGES)
    with r.scheduler(args):
        with r.Engine(args) as writer:
            written = writer.insert(tokens, seed=5)
            writer.settle_backups()
        with r.Engine(args) as reader:
            _detach_and_attach(cluster, reader, extra, tokens, written)
    assert leaks.wait_no_kvconnect_threads() == []


def _detach_and_attach(
    cluster: Cluster, reader: r.Engine, extra: dict[str, Any], tokens: list[int], written: Any
) -> None:
    server = cluster.servers[0]
    server.signal(signal.SIGSTOP)
    try:
        handle = reader.prefetch("req-in-flight", tokens)
        operation = reader.operation(handle)
        reader.pump(
            lambda: (
                operation.host_indices is not None and reader.controller.prefetch_buffer.empty()
            ),
            "the prefetch never started reading",
        )
        backend = reader.backend
        reader.detach()  # SGLang joins its IO thread: it leaves kvconnect by the read deadline
        assert reader.backend is None
        assert not reader.cache.enable_storage
        # the closed backend leaves no thread that could still write into the pool
        assert leaks.wait_no_kvconnect_threads(timeout=10) == []
        assert backend.stats.errors == 0
        assert backend.stats.pages_read == 0
        # the interrupted prefetch's slots (SGLang keeps them) and every free slot get a
        # sentinel: nothing may change them when the server resumes
        pool = reader.host_pool
        taken = pool.alloc(pool.available_size())
        expected = r.sentinel(pool, torch.cat([operation.host_indices, taken]))
    finally:
        server.signal(signal.SIGCONT)
    pool.free(taken[: PAGES * h.PAGE])  # room for the prefetch below
    kept = torch.cat([operation.host_indices, taken[PAGES * h.PAGE :]])
    reader.attach(extra)
    assert reader.backend is not None
    assert reader.backend is not backend
    again = reader.run_prefetch("req-after-attach", tokens)
    assert reader.host_hit(tokens) == len(tokens)
    assert reader.landed(again, tokens) == written
    assert r.page_bytes(pool, kept) == expected[: len(kept) // h.PAGE * h.PAGE_BYTES]
    pool.free(taken[PAGES * h.PAGE :])


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def _kvconnect_warnings() -> Iterator[list[str]]:
    """The WARNING (and worse) lines kvconnect logs inside. SGLang's logging set-up replaces
    the root handlers, pytest's capture among them: the handler goes on kvconnect's logger."""
    records, logger = _Records(), logging.getLogger("kvconnect")
    logger.addHandler(records)
    try:
        yield records.lines
    finally:
        logger.removeHandler(records)


def test_a_dead_store_means_local_only_then_recovery_by_itself(
    cluster: Cluster, model_dir: Path
) -> None:
    failures = 3
    # a cool-down longer than the calls below: they all fail fast, none is a probe
    extra = _extra(
        cluster, breaker_failures=failures, breaker_cooldown=2.0, prefetch_threshold=h.PAGE
    )
    args = r.args(model_dir, extra)
    with r.scheduler(args), r.Engine(args) as writer, r.Engine(args) as reader:
        before = h.tokens_for(4, seed=1)
        writer.insert(before, seed=1)
        writer.settle_backups()
        assert cluster.stats().keys == 2 * 4
        with _kvconnect_warnings() as warnings:
            _outage(cluster, writer, reader, before, failures)
        # per engine: the switch to local-only and the first failure of each kind
        assert 0 < len(warnings) <= 6, warnings
        # the store returns on the same ports, empty: SGLang's next lookups probe it
        cluster.restart_master()
        for server in cluster.servers:
            server.start()
        wait_for(lambda: len(cluster.stats().segments) == 1, "the server did not register")
        for engine in (reader, writer):
            wait_for(
                lambda engine=engine: engine.lookup(before) == 0 and not engine.backend.local_only,
                "no recovery",
            )
        after = h.tokens_for(PAGES, seed=2)
        written = writer.insert(after, seed=2)
        writer.settle_backups()
        assert cluster.stats().keys == 2 * PAGES
        handle = reader.run_prefetch("req-up", after)
        assert reader.host_hit(after) == len(after)
        assert reader.landed(handle, after) == written


def _outage(
    cluster: Cluster, writer: r.Engine, reader: r.Engine, before: list[int], failures: int
) -> None:
    cluster.master.kill()
    for server in cluster.servers:
        server.kill()
    # each failed lookup is a miss; after breaker_failures of them, local-only
    for i in range(failures):
        reader.run_prefetch(f"req-down-{i}", before)
        assert reader.host_hit(before) == 0
    assert reader.backend.local_only
    # many more prefetches and backups while it lasts: misses and skipped writes, no
    # exception into SGLang's threads, no log line per call
    for i in range(10):
        reader.run_prefetch(f"req-local-{i}", before)
        writer.insert(h.tokens_for(1, seed=100 + i), seed=100 + i)
        writer.settle_backups()
    assert reader.host_hit(before) == 0
    assert writer.backend.local_only
    for engine in (reader, writer):
        controller = engine.controller
        threads = (controller.prefetch_thread, controller.prefetch_io_aux_thread)
        assert all(t.is_alive() for t in (*threads, controller.backup_thread))
        assert engine.backend.stats.errors == 0


def test_a_reader_of_another_group_prefetches_through_federation(
    model_dir: Path, tmp_path: Path
) -> None:
    """The writer's group has its own cluster and token; the reader's cluster is empty and
    names the writer's as a peer: SGLang's prefetch lands the writer's pages from there."""
    tokens_a, tokens_b = tmp_path / "a.token", tmp_path / "b.token"
    for path, text in (
        (tokens_a, "group-a-token-0123456789"),
        (tokens_b, "group-b-token-9876543210"),
    ):
        path.write_text(text + "\n")
        path.chmod(0o600)
    with (
        Cluster(servers=1, server_size=16 << 20, token_file=str(tokens_a)) as home,
        Cluster(servers=1, server_size=16 << 20, token_file=str(tokens_b)) as peer,
    ):
        settings = {**FAST, "prefetch_threshold": h.PAGE}
        args = r.args(
            model_dir, {"master": peer.master_endpoint, "token_file": str(tokens_b), **settings}
        )
        with r.scheduler(args), r.Engine(args) as writer, r.Engine(args) as reader:
            tokens = h.tokens_for(PAGES)
            written = writer.insert(tokens, seed=4)
            writer.settle_backups()
            assert peer.stats().keys == 2 * PAGES
            reader.detach()
            group_b = {
                "name": "group-b",
                "master": peer.master_endpoint,
                "token_file": str(tokens_b),
                "rpc_timeout": 2.0,  # the data path, not the peer's timeout (test_federation)
            }
            reader.attach(
                {
                    "master": home.master_endpoint,
                    "token_file": str(tokens_a),
                    **settings,
                    "store": {"peers": [group_b]},
                }
            )
            handle = reader.run_prefetch("req-federated", tokens)
            assert reader.host_hit(tokens) == len(tokens)
            assert reader.landed(handle, tokens) == written
            assert home.stats().keys == 0  # every page came from the peer cluster
