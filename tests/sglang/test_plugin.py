"""The literal ``--hicache-storage-backend kvconnect`` route, and keys across TP ranks."""

from __future__ import annotations

import importlib.metadata
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.unified_cache.storage_attachment import StorageAttachment
from sglang.srt.mem_cache.unified_radix_cache import _StoragePrefetchWait
from sglang.srt.runtime_context import get_memory
from sglang.srt.server_args import prepare_server_args

from kvconnect.errors import ConfigError
from kvconnect.sglang import backend as backend_module
from kvconnect.sglang import plugin
from kvconnect.sglang.backend import KVConnectStore
from kvconnect.sglang.deadline import PrefetchBudget, PrefetchPolicy
from kvconnect.sglang.plugin import DYNAMIC_ROUTE
from kvconnect.store.client import StoreClient
from kvconnect.store.launch import Cluster
from tests.sglang import harness as h

pytestmark = [pytest.mark.integration, pytest.mark.sglang]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(servers=1, server_size=32 << 20) as c:
        yield c


def test_sglang_own_parser_accepts_kvconnect(plugins_loaded: None) -> None:
    args = prepare_server_args(
        [
            *("--model-path", "some/model", "--device", "cpu"),
            "--enable-hierarchical-cache",
            *("--hicache-storage-backend", "kvconnect"),
            *("--hicache-storage-backend-extra-config", '{"master": "tcp://10.0.0.1:50051"}'),
        ]
    )
    assert args.hicache_storage_backend == "kvconnect"


def test_the_factory_builds_it_with_the_host_pool_and_zero_copy(
    plugins_loaded: None, cluster: Cluster
) -> None:
    pool = h.mha_pool()
    extra = {"master": cluster.master_endpoint}
    cc = h.controller(pool, "kvconnect", extra, enable_storage_metrics=True)
    try:
        assert isinstance(cc.storage_backend, KVConnectStore)
        assert cc.storage_backend.mem_pool_host is pool
        assert cc.page_get_func.__wrapped__ == cc._page_get_zero_copy, "reads see operations"
        assert cc.page_set_func == cc._page_set_zero_copy
        tokens = h.tokens_for(20, seed=7)
        source = pool.alloc(len(tokens))
        h.fill(pool, source, seed=7)
        expected = h.pages_of(pool, source)
        assert h.backup(cc, source, tokens) == len(tokens)
        pool.free(source)
        pool.kv_buffer.zero_()
        result = h.prefetch(cc, "req-plugin", tokens)
        assert h.pages_of(pool, result.host_indices) == expected
        h.release(cc, result)
        metrics = cc.storage_backend.get_stats()
        assert sum(metrics.backup_pgs) == 20
        assert sum(metrics.prefetch_pgs) == 20
        assert cc.storage_backend.get_stats().prefetch_pgs == [], "samples are handed out once"
    finally:
        cc.detach_storage_backend()
    # the factory refuses nothing else it knew: other names still reach SGLang's own branches
    assert "file" in StorageBackendFactory._registry


def test_the_backend_follows_the_prefetch_budget_the_radix_cache_publishes(
    plugins_loaded: None, cluster: Cluster
) -> None:
    cc = h.controller(h.mha_pool(), "kvconnect", {"master": cluster.master_endpoint})
    try:
        backend = cc.storage_backend
        assert backend.prefetch_budget == PrefetchBudget.of(page_size=h.PAGE), "SGLang's defaults"
        # What SGLang's radix cache does at start and at every attach: the knobs its own
        # timeout verdict reads, published on the cache (the one part of it this touches).
        cache = SimpleNamespace(
            enable_storage=True,
            page_size=h.PAGE,
            cache_controller=cc,
            prefetch_stop_policy="timeout",
            _storage_prefetch_wait={},
        )
        StorageAttachment(cache).apply_runtime_config(
            storage_backend="kvconnect",
            prefetch_threshold=h.PAGE,
            prefetch_timeout_base=3.0,
            prefetch_timeout_per_ki_token=0.5,
            hicache_storage_pass_prefix_keys=False,
            enable_storage=True,
            enable_storage_metrics=False,
            extra_metric_labels=None,
        )
        assert backend.prefetch_budget == PrefetchBudget.of("timeout", 3.0, 0.5, page_size=h.PAGE)
        cache.prefetch_stop_policy = "wait_complete"  # a policy update at runtime
        assert backend.prefetch_budget.policy is PrefetchPolicy.WAIT_COMPLETE
    finally:
        cc.detach_storage_backend()


def test_sglangs_running_prefetch_clock_is_read_where_sglang_keeps_it() -> None:
    handle = CacheRequestHandle(rid="req-clock", attempt_id=0)
    cache = SimpleNamespace(_storage_prefetch_wait={})
    clock = plugin.RadixCacheClock(cache)
    operation = SimpleNamespace(handle=handle)
    assert clock.verdict(operation) is None, "no blocked admission poll yet"
    wait = _StoragePrefetchWait(timeout_s=30.0)
    before = time.monotonic()
    wait.timer.observe(ready=False)  # what SGLang's first blocked poll does
    after = time.monotonic()
    cache._storage_prefetch_wait[handle] = wait
    verdict = clock.verdict(operation)
    assert verdict is not None
    assert before + 30.0 - 0.01 <= verdict <= after + 30.0 + 0.01  # perf_counter → monotonic
    wait.expired = True  # a rank-agreed verdict: it has fallen
    fallen = clock.verdict(operation)
    assert fallen is not None
    assert fallen <= time.monotonic()


def test_sglang_own_extra_config_keys_are_left_to_sglang(cluster: Cluster, tmp_path: Path) -> None:
    # --file-storage-path makes SGLang add file_storage_path to every backend's extra-config;
    # the prefetch settings are SGLang's too. All reach kvconnect's parser on some path.
    extra = {
        **DYNAMIC_ROUTE,
        "prefetch_threshold": 64,
        "prefetch_timeout_base": 2,
        "master": cluster.master_endpoint,
        "namespace": "sglang-keys",
    }
    args = h.server_args(
        tmp_path / "model",
        *("--hicache-storage-backend", "dynamic"),
        *("--hicache-storage-backend-extra-config", json.dumps(extra)),
        *("--file-storage-path", str(tmp_path / "files")),
    )
    built = h.storage_extra_config(args)
    assert built["file_storage_path"] == str(tmp_path / "files"), "SGLang's own addition"
    pool = h.mha_pool()
    cc = h.controller(pool, "dynamic", {**built, "prefetch_timeout_per_ki_token": 0.5})
    try:
        backend = cc.storage_backend
        assert isinstance(backend, KVConnectStore)
        assert backend.config.namespace == "sglang-keys"
        tokens = h.tokens_for(4, seed=13)
        source = pool.alloc(len(tokens))
        h.fill(pool, source, seed=13)
        assert h.backup(cc, source, tokens) == len(tokens)
        assert backend.batch_exists(h.page_hashes(tokens)) == 4
    finally:
        cc.detach_storage_backend()
    with pytest.raises(ConfigError, match=r"file_storge_path.*prefetch_threshold"):
        KVConnectStore(_storage(cluster, 0, False, file_storge_path="/x"))


@pytest.mark.parametrize("route", ["kvconnect", "dynamic"])
@pytest.mark.parametrize(
    ("flags", "layout", "io"),
    [
        ((), "page_first", "kernel"),  # SGLang's defaults
        (("--hicache-mem-layout", "layer_first"), "page_first", "kernel"),
        (
            ("--hicache-mem-layout", "layer_first", "--hicache-io-backend", "direct"),
            "page_first_direct",
            "direct",
        ),
        (("--hicache-io-backend", "direct"), "page_first_direct", "direct"),
        (("--hicache-mem-layout", "page_head"), "page_head", "kernel"),
    ],
    ids=["default", "layer_first", "layer_first-direct", "direct", "page_head"],
)
def test_sglang_resolves_a_page_layout_kvconnect_attaches_to(
    plugins_loaded: None,
    cluster: Cluster,
    tmp_path: Path,
    route: str,
    flags: tuple[str, ...],
    layout: str,
    io: str,
) -> None:
    extra = {"master": cluster.master_endpoint, **(DYNAMIC_ROUTE if route == "dynamic" else {})}
    args = h.server_args(
        tmp_path / "model",
        *("--hicache-storage-backend", route),
        *("--hicache-storage-backend-extra-config", json.dumps(extra)),
        *flags,
    )
    with h.scheduler_context(args):  # the values SGLang's scheduler builds its pools from
        resolved = (get_memory().hicache_mem_layout, get_memory().hicache_io_backend)
    assert resolved == (layout, io)
    pool = h.mha_pool(layout)
    backend = KVConnectStore(_storage(cluster, 0, False, namespace=f"resolved-{route}"), pool)
    try:
        assert backend.mem_pool_host is pool
        _round_trip(backend, pool, seed=len(flags))
    finally:
        backend.close()


@pytest.mark.parametrize(
    "extra",
    [{}, {**DYNAMIC_ROUTE, "module_path": "other.module", "class_name": "Other"}],
    ids=["file", "dynamic-other"],
)
def test_other_backends_keep_the_layout_they_asked_for(
    plugins_loaded: None, tmp_path: Path, extra: dict[str, Any]
) -> None:
    args = h.server_args(
        tmp_path / "model",
        *("--hicache-storage-backend", "dynamic" if extra else "file"),
        *("--hicache-storage-backend-extra-config", json.dumps(extra)),
        *("--hicache-mem-layout", "layer_first"),
    )
    with h.scheduler_context(args):
        assert get_memory().hicache_mem_layout == "layer_first"


def test_a_runtime_attach_to_a_layer_first_pool_is_refused_with_the_fix(
    plugins_loaded: None, cluster: Cluster
) -> None:
    # The one way layer_first still reaches kvconnect: a server started without L3 on
    # layer_first, attached at runtime (/hicache/storage-backend). SGLang rolls the attach back.
    cc = h.controller(h.mha_pool("layer_first", pages=8), None, {})
    try:
        refused = r"not 'layer_first'.*--hicache-mem-layout page_first"
        with pytest.raises(ConfigError, match=refused):
            cc.attach_storage_backend(
                "kvconnect", storage_backend_extra_config={"master": cluster.master_endpoint}
            )
        assert (cc.enable_storage, cc.storage_backend) == (False, None)
    finally:
        cc.detach_storage_backend()


def test_other_sglang_versions_are_refused_with_a_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda _name: "0.6.0")
    with pytest.raises(RuntimeError, match=r"supports SGLang 0\.5\.23, found 0\.6\.0.*dynamic"):
        plugin.register()


def test_store_and_transfer_sections_reach_the_client_and_its_engine(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    clients: list[StoreClient] = []

    class Recorded(StoreClient):
        def start(self) -> None:
            clients.append(self)
            super().start()

    monkeypatch.setattr(backend_module, "StoreClient", Recorded)
    sections = {"store": {"replicas": 2}, "transfer": {"tcp_streams": 3}, "read_timeout": 1.5}
    backend = KVConnectStore(_storage(cluster, 0, False, **sections))
    try:
        (client,) = clients
        assert client.config.replicas == 2
        assert backend.config.read_timeout == 1.5
        assert client.config.master == cluster.master_endpoint
        assert client.engine.config.tcp_streams == 3
    finally:
        backend.close()


def _storage(cluster: Cluster, rank: int, mla: bool, **extra: Any) -> HiCacheStorageConfig:
    extra = {"namespace": f"ranks-{mla}", **extra}
    return h.rank_storage(cluster.master_endpoint, rank, mla, **extra)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_mha_ranks_keep_their_own_pages_and_mla_ranks_share_one(
    cluster: Cluster, mla: bool
) -> None:
    pools = [h.mla_pool() if mla else h.mha_pool() for _ in range(2)]
    backends = [
        KVConnectStore(_storage(cluster, rank, mla), pool) for rank, pool in enumerate(pools)
    ]
    try:
        hashes = h.page_hashes(h.tokens_for(8, seed=9))
        slots: list[Any] = []
        for rank, (backend, pool) in enumerate(zip(backends, pools, strict=True)):
            source = pool.alloc(8 * h.PAGE)
            h.fill(pool, source, seed=100 + rank)  # each rank's shard of the heads differs
            slots.append(source)
            before = cluster.stats().keys
            assert backend.batch_set_v1(hashes, source) == [True] * 8
            written = cluster.stats().keys - before
            objects = 8 if mla else 16
            assert written == (objects if rank == 0 or not mla else 0), "MLA: rank 0 writes"
        for rank, (backend, pool) in enumerate(zip(backends, pools, strict=True)):
            expected = h.pages_of(pool, slots[rank])
            target = pool.alloc(8 * h.PAGE)
            assert backend.batch_exists(hashes) == 8
            assert backend.batch_get_v1(hashes, target) == [True] * 8
            got = h.pages_of(pool, target)
            if mla:  # every rank reads the one copy rank 0 wrote
                assert got == h.pages_of(pools[0], slots[0])
            else:  # its own shard, not the other rank's
                assert got == expected
                assert got != h.pages_of(pools[1 - rank], slots[1 - rank])
    finally:
        for backend in backends:
            backend.close()


def test_unsupported_pools_are_refused_at_attach_with_the_fix(cluster: Cluster) -> None:
    with pytest.raises(ConfigError, match="--hicache-mem-layout page_first"):
        KVConnectStore(_storage(cluster, 0, False), h.mha_pool("layer_first")).close()
    backend = KVConnectStore(_storage(cluster, 0, False), h.mha_pool())
    try:
        backend.register_mem_host_pool_v2(backend.mem_pool_host, PoolName.KV)  # fine
        backend.register_mem_host_pool_v2(h.mha_pool(), PoolName.SWA)  # a hybrid model's
        with pytest.raises(ConfigError, match="DeepSeek-V4"):
            backend.register_mem_host_pool_v2(h.mha_pool(), PoolName.DEEPSEEK_V4_C4)
        with pytest.raises(ConfigError, match="--hicache-mem-layout page_first"):
            backend.register_mem_host_pool_v2(h.mha_pool("layer_first"), PoolName.DRAFT)
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("nodes", "per_rank"), [(1, 4 << 20), (2, 8 << 20)], ids=["one-host", "two-hosts"]
)
def test_an_engine_lends_local_store_size_per_host(
    tmp_path: Path, nodes: int, per_rank: int
) -> None:
    # A TP-2 engine lends 8 MiB per host: its two ranks share it on one host; spread over two
    # hosts, each host's one rank lends all of it.
    flags = ["--tp-size", "2", "--nnodes", str(nodes)]
    if nodes > 1:
        flags += ["--dist-init-addr", "127.0.0.1:5000"]
    args = h.server_args(tmp_path / "model", *flags)
    with Cluster(servers=0) as bare:  # a master and no store server
        pools = [h.mha_pool(), h.mha_pool()]
        backends: list[KVConnectStore] = []
        try:
            with h.scheduler_context(args):
                for rank, pool in enumerate(pools):
                    storage = _storage(bare, rank, False, local_store_size=8 << 20)
                    backends.append(KVConnectStore(storage, pool))
            assert [s.capacity for s in bare.stats().segments] == [per_rank, per_rank]
            hashes = h.page_hashes(h.tokens_for(16, seed=11))
            source = pools[0].alloc(16 * h.PAGE)
            h.fill(pools[0], source, seed=11)
            assert backends[0].batch_set_v1(hashes, source) == [True] * 16
            target = pools[0].alloc(16 * h.PAGE)
            assert backends[0].batch_get_v1(hashes, target) == [True] * 16
            assert h.pages_of(pools[0], target) == h.pages_of(pools[0], source)
        finally:
            for backend in backends:
                backend.close()


def test_local_store_size_needs_sglang_parallel_configuration(cluster: Cluster) -> None:
    with pytest.raises(ConfigError, match="local_store_size is shared by the SGLang ranks"):
        KVConnectStore(_storage(cluster, 0, False, local_store_size=8 << 20), h.mha_pool())


def test_the_backend_takes_the_cluster_token_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVCONNECT_TOKEN", "sglang-test-token")  # store servers inherit it
    with Cluster(servers=1, server_size=8 << 20) as secured:
        pool = h.mha_pool()
        backend = KVConnectStore(_storage(secured, 0, False), pool)
        try:
            _round_trip(backend, pool, seed=17)
        finally:
            backend.close()


def _round_trip(backend: Any, pool: Any, seed: int) -> None:
    """Two pages written through ``backend`` and read back into other slots, byte-exact."""
    hashes = h.page_hashes(h.tokens_for(2, seed=seed))
    source = pool.alloc(2 * h.PAGE)
    h.fill(pool, source, seed=seed)
    assert backend.batch_set_v1(hashes, source) == [True, True]
    target = pool.alloc(2 * h.PAGE)
    assert backend.batch_get_v1(hashes, target) == [True, True]
    assert h.pages_of(pool, target) == h.pages_of(pool, source)
