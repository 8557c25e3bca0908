"""The backend's metrics under SGLang's real controller, against a real kvconnect cluster:
SGLang's storage samples (``get_stats``) and kvconnect's Prometheus series, scraped as text
from this process's registry and, as SGLang's HTTP server does, from a multiprocess directory
written by another process.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from kvconnect.sglang.backend import KVConnectStore
from kvconnect.sglang.metrics import GIB
from kvconnect.store.launch import Cluster
from tests.sglang import harness as h
from tests.support.child import child_env
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.sglang]

RANK0 = {"tp_rank": "0", "pp_rank": "0", "dp_rank": "0", "attn_cp_rank": "0"}
FAST = {"rpc_timeout": 0.5, "breaker_cooldown": 0.5}
CHILD_TIMEOUT = 120.0

Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _dynamic(master: str, **settings: Any) -> dict[str, Any]:
    return h.dynamic({"master": master, **FAST, **settings})


def _parse(text: str) -> Scrape:
    """Every sample of a Prometheus text exposition, by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _scrape() -> Scrape:
    return _parse(generate_latest(REGISTRY).decode())


def _value(scrape: Scrape, name: str, **labels: str) -> float:
    """A kvconnect_hicache series of rank 0 (0 while it has no sample)."""
    key = (f"kvconnect_hicache_{name}", frozenset({**RANK0, **labels}.items()))
    return scrape.get(key, 0.0)


def _delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return _value(after, name, **labels) - _value(before, name, **labels)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(servers=1, server_size=32 << 20) as c:
        yield c


def test_reads_writes_and_errors_are_counted(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = h.mha_pool()
    cc = h.controller(
        pool, "dynamic", _dynamic(cluster.master_endpoint), enable_storage_metrics=True
    )
    backend = cc.storage_backend
    try:
        tokens = h.tokens_for(20, seed=21)
        source = pool.alloc(len(tokens))
        h.fill(pool, source, seed=21)
        expected = h.pages_of(pool, source)
        before = _scrape()
        assert h.backup(cc, source, tokens) == len(tokens)
        assert h.backup(cc, source, tokens) == len(tokens), "again: every page already stored"
        pool.free(source)
        pool.kv_buffer.zero_()
        result = h.prefetch(cc, "req-metrics", tokens)
        assert h.pages_of(pool, result.host_indices) == expected
        h.release(cc, result)
        after = _scrape()

        assert _delta(before, after, "pages_written_total") == 20
        assert _delta(before, after, "pages_skipped_total") == 20
        assert _delta(before, after, "written_bytes_total") == 20 * h.PAGE_BYTES
        assert _delta(before, after, "pages_hit_total") == 20
        assert _delta(before, after, "pages_missed_total") == 0
        assert _delta(before, after, "partial_reads_total") == 0
        assert _delta(before, after, "read_bytes_total") == 20 * h.PAGE_BYTES
        assert _delta(before, after, "batch_seconds_count", op="write") == 2
        assert _delta(before, after, "batch_seconds_count", op="read") == 1
        assert _delta(before, after, "batch_seconds_count", op="exists") >= 1  # the hit query
        assert _value(after, "breaker_state", state="closed") == 1
        assert _value(after, "breaker_state", state="open") == 0

        # SGLang's samples: the write that moved the pages (the second moved none), the read;
        # GiB/s over the call's own time, which the latency histogram got too
        samples = backend.get_stats()
        assert samples.backup_pgs == [20]
        assert samples.prefetch_pgs == [20]
        seconds = _delta(before, after, "batch_seconds_sum", op="read")
        assert samples.prefetch_bandwidth == [pytest.approx(20 * h.PAGE_BYTES / GIB / seconds)]
        assert backend.get_stats().prefetch_pgs == [], "handed out once"

        def broken(host_indices: Any) -> Any:
            raise ValueError("a bug in page addressing")

        monkeypatch.setattr(backend._memory, "locate", broken)
        failed = h.prefetch(cc, "req-broken", tokens)
        assert failed.completed_tokens == 0
        h.release(cc, failed)
        assert _delta(after, _scrape(), "errors_total", call="batch_get_v1") == 1
    finally:
        cc.detach_storage_backend()


def test_a_read_cut_by_its_deadline_counts_partial_reuse_and_an_expiry() -> None:
    # Server A holds exactly the first 5 pages (full, never evicting); the other 5 go to
    # server B, which then stops. Over TCP: a stopped process serves nothing.
    with Cluster(servers=0, master_args=["--master-high-watermark", "1.0"]) as cluster:
        cluster.add_server("--store-size", str(5 * h.PAGE_BYTES))
        pool = h.mha_pool()
        settings = {"transport": "tcp", "read_timeout": 0.5}
        extra = _dynamic(cluster.master_endpoint, **settings)
        cc = h.controller(pool, "dynamic", extra, enable_storage_metrics=True)
        try:
            tokens = h.tokens_for(10, seed=22)
            hashes = h.page_hashes(tokens)
            source = pool.alloc(len(tokens))
            h.fill(pool, source, seed=22)
            expected = h.pages_of(pool, source)
            half = 5 * h.PAGE
            assert h.backup(cc, source[:half], tokens[:half], hashes[:5]) == half
            slow = cluster.add_server("--store-size", str(32 << 20))
            assert h.backup(cc, source[half:], tokens[half:], hashes[5:]) == half
            pool.free(source)
            pool.kv_buffer.zero_()
            before = _scrape()
            slow.signal(signal.SIGSTOP)
            try:
                result = h.prefetch(cc, "req-cut", tokens)
            finally:
                slow.signal(signal.SIGCONT)
            after = _scrape()
            assert result.completed_tokens == half
            assert h.pages_of(pool, result.host_indices)[:5] == expected[:5]
            h.release(cc, result)
            assert _delta(before, after, "pages_hit_total") == 5
            assert _delta(before, after, "pages_missed_total") == 5
            assert _delta(before, after, "partial_reads_total") == 1
            assert _delta(before, after, "partial_read_pages_total") == 5
            assert _delta(before, after, "deadline_expiries_total") == 1
            assert _delta(before, after, "read_bytes_total") == 5 * h.PAGE_BYTES
            assert cc.storage_backend.get_stats().prefetch_pgs[-1] == 5
        finally:
            cc.detach_storage_backend()


def test_the_breaker_gauge_follows_an_outage_and_the_recovery() -> None:
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        pool = h.mha_pool()
        cc = h.controller(
            pool, "dynamic", _dynamic(cluster.master_endpoint), enable_storage_metrics=True
        )
        backend = cc.storage_backend
        try:
            hashes = h.page_hashes(h.tokens_for(4, seed=23))
            assert backend.batch_exists(hashes) == 0
            assert _value(_scrape(), "breaker_state", state="closed") == 1
            cluster.master.kill()
            wait_for(lambda: backend.batch_exists(hashes) == 0 and backend.local_only, "no open")
            down = _scrape()
            assert _value(down, "breaker_state", state=str(backend.breaker_state)) == 1
            assert _value(down, "breaker_state", state="closed") == 0
            cluster.restart_master()
            wait_for(
                lambda: backend.batch_exists(hashes) == 0 and not backend.local_only,
                "no recovery",
                20,
            )
            up = _scrape()
            assert _value(up, "breaker_state", state="closed") == 1
            assert _value(up, "breaker_state", state="open") == 0
        finally:
            cc.detach_storage_backend()


def test_peer_series_count_lookups_and_hits_per_peer(cluster: Cluster, tmp_path: Path) -> None:
    """A reader whose own cluster names ``cluster`` as its peer (tokens of their own) reads
    the writer's pages from there and counts them by peer."""
    token = tmp_path / "home.token"
    token.write_text("home-cluster-token-0123456789\n")
    token.chmod(0o600)
    tokens = h.tokens_for(3, seed=27)
    pool = h.mha_pool()
    writer = h.controller(pool, "dynamic", _dynamic(cluster.master_endpoint))
    try:
        source = pool.alloc(len(tokens))
        h.fill(pool, source, seed=27)
        expected = h.pages_of(pool, source)
        assert h.backup(writer, source, tokens) == len(tokens)
    finally:
        writer.detach_storage_backend()
    # the counts, not the peer's timeout (test_federation): room for a loaded machine
    peer = {"name": "group-b", "master": cluster.master_endpoint, "rpc_timeout": 2.0}
    with Cluster(servers=1, server_size=8 << 20, token_file=str(token)) as home:
        settings = {"token_file": str(token), "store": {"peers": [peer]}}
        pool = h.mha_pool()
        reader = h.controller(
            pool, "dynamic", _dynamic(home.master_endpoint, **settings), enable_storage_metrics=True
        )
        try:
            before = _scrape()
            result = h.prefetch(reader, "req-peer", tokens)
            assert h.pages_of(pool, result.host_indices) == expected
            h.release(reader, result)
            after = _scrape()
            assert _value(after, "peer_up", peer="group-b") == 1
            hits = _delta(before, after, "peer_keys_total", peer="group-b", outcome="hit")
            assert hits == 2 * 3  # K and V of each page
            assert _delta(before, after, "pages_hit_total") == 3
            assert home.stats().keys == 0
        finally:
            reader.detach_storage_backend()


def test_without_enable_metrics_nothing_is_recorded(cluster: Cluster) -> None:
    pool = h.mha_pool()
    cc = h.controller(pool, "dynamic", _dynamic(cluster.master_endpoint))
    backend = cc.storage_backend
    try:
        assert not backend.metrics.enabled
        tokens = h.tokens_for(6, seed=24)
        source = pool.alloc(len(tokens))
        h.fill(pool, source, seed=24)
        before = _scrape()
        assert h.backup(cc, source, tokens) == len(tokens)
        pool.free(source)
        result = h.prefetch(cc, "req-quiet", tokens)
        assert result.completed_tokens == len(tokens)
        h.release(cc, result)
        after = {key: value for key, value in _scrape().items() if "kvconnect_hicache" in key[0]}
        assert after == {key: value for key, value in before.items() if key in after}
        assert backend.stats.pages_read == 6, "the backend's own counters still count"
        samples = backend.get_stats()
        assert samples.prefetch_pgs == samples.backup_pgs == []
    finally:
        cc.detach_storage_backend()


def test_series_reach_a_multiprocess_directory_like_sglang_schedulers(
    cluster: Cluster, tmp_path: Path
) -> None:
    # SGLang's scheduler processes run with PROMETHEUS_MULTIPROC_DIR set; its HTTP server
    # collects that directory. The child plays a scheduler (and a second rank's backend); this
    # process, the server.
    directory = tmp_path / "prometheus"
    directory.mkdir()
    command = [sys.executable, "-m", "tests.sglang.test_metrics", cluster.master_endpoint]
    env = {**child_env(), "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"identical": True}
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    scraped = _parse(generate_latest(registry).decode())
    assert _value(scraped, "pages_written_total") == 8
    assert _value(scraped, "pages_written_total", tp_rank="1") == 3, "each rank its own series"
    assert _value(scraped, "pages_hit_total") == 8
    assert _value(scraped, "read_bytes_total") == 8 * h.PAGE_BYTES
    assert _value(scraped, "batch_seconds_count", op="read") == 1
    assert _value(scraped, "breaker_state", state="closed") == 1


def _scheduler_child(master: str) -> None:
    """The child of the multiprocess test: 8 pages written and read back, as one rank."""
    import tests.sglang.conftest  # noqa: F401  # SGLang's caches and one-rank set-up

    pool = h.mha_pool()
    cc = h.controller(pool, "dynamic", _dynamic(master), enable_storage_metrics=True)
    try:
        tokens = h.tokens_for(8, seed=25)
        source = pool.alloc(len(tokens))
        h.fill(pool, source, seed=25)
        expected = h.pages_of(pool, source)
        assert h.backup(cc, source, tokens) == len(tokens)
        pool.free(source)
        pool.kv_buffer.zero_()
        result = h.prefetch(cc, "req-child", tokens)
        identical = h.pages_of(pool, result.host_indices) == expected
        h.release(cc, result)
    finally:
        cc.detach_storage_backend()
    # Another rank's backend (as a TP-2 engine's second scheduler would have): its own series.
    other_pool = h.mha_pool()
    other = KVConnectStore(_rank_config(master, tp_rank=1, tp_size=2), other_pool)
    try:
        slots = other_pool.alloc(3 * h.PAGE)
        h.fill(other_pool, slots, seed=26)
        assert other.batch_set_v1(h.page_hashes(h.tokens_for(3, seed=26)), slots) == [True] * 3
    finally:
        other.close()
    print(json.dumps({"identical": identical}))


def _rank_config(master: str, *, tp_rank: int, tp_size: int) -> HiCacheStorageConfig:
    """What SGLang's controller gives the backend of one rank, with ``--enable-metrics``."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=True,
        is_page_first_layout=True,
        model_name="test/model",
        extra_config={"master": master, **FAST},
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    _scheduler_child(parser.parse_args().master)
