"""Hybrid models' sidecar pools through SGLang's real controller, against a real cluster.

SGLang's own host pools for each sidecar kind (sliding window, Mamba state, DSA indexer, MTP
draft) sit next to the KV pool in the controller's ``HostPoolGroup``, as SGLang's hybrid
assembler groups them; the controller's backup, prefetch and ack threads move them through
kvconnect's v2 methods. The device side is a stand-in (the storage path never touches it).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.host_pool_decl import HostPoolDecl, HostPoolStorageInfo
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

from kvconnect.sglang import KVConnectStore
from kvconnect.store.launch import Cluster
from kvconnect.store.messages import Code
from tests.sglang import harness as h
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.sglang]

PAGES = 10
MAMBA_SLOTS = 16


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(servers=2, server_size=32 << 20) as c:
        yield c


_MODELS = itertools.count()


# ------------------------------------------------------------------ SGLang's sidecar pools


def _mamba_pool(_kv: Any) -> MambaPoolHost:
    """Qwen3-Next's state pool: one temporal (SSM) state and two conv states per slot."""
    layers = 2
    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, MAMBA_SLOTS, 4, 8),
        conv=(torch.zeros(layers, MAMBA_SLOTS, 3, 8), torch.zeros(layers, MAMBA_SLOTS, 5, 8)),
    )
    return MambaPoolHost(
        info, 2.0, 0, device_capacity=MAMBA_SLOTS, pin_memory=False, layout="page_first"
    )


def _indexer_pool(kv: Any, name: PoolName = PoolName.INDEXER) -> DSAIndexerPoolHost:
    """DeepSeek-V3.2's indexer keys (or its MTP draft's), laid out on the MLA KV pool's slots
    (as SGLang's ``make_dsa_indexer_pool_decl`` declares them; the device pool is a
    stand-in)."""
    device = types.SimpleNamespace(
        store_dtype=torch.uint8,
        start_layer=0,
        end_layer=h.LAYERS - 1,
        layer_num=h.LAYERS,
        device=torch.device("cpu"),
        index_k_with_scale_buffer=[torch.zeros(8, 64, dtype=torch.uint8)] * h.LAYERS,
        layer_shard_enabled=False,
    )
    decl = HostPoolDecl(
        pool_name=name,
        device_pool=device,
        indices_from_pool=PoolName.KV,
        layout_source=PoolName.KV,
        storage_info=HostPoolStorageInfo(bytes_per_token_per_layer=8, dtype=torch.uint8),
        host_pool_builder=None,
    )
    return DSAIndexerPoolHost(decl, kv, pin_memory=False)


@dataclass(frozen=True)
class Kind:
    """One sidecar pool kind: its name, the KV pool it rides with, how SGLang builds it and
    how many trailing pages it keeps (0: every page, on the KV pool's slots)."""

    name: PoolName
    kv: Callable[[], Any]
    build: Callable[[Any], Any]
    window: int

    def backup_transfer(self, pool: Any, hashes: list[str], seed: int) -> PoolTransfer:
        """The transfer SGLang's radix cache adds to a node's backup."""
        if not self.window:
            return PoolTransfer(name=self.name, indices_from_pool=PoolName.KV)
        slots = pool.alloc(self.window * pool.page_size)
        _fill(pool, slots, seed)
        return PoolTransfer(
            name=self.name,
            host_indices=slots,
            keys=hashes[-self.window :],
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )

    def prefetch_transfer(self) -> PoolTransfer:
        """The transfer SGLang's radix cache adds to a prefetch (a window: placeholders)."""
        if not self.window:
            return PoolTransfer(name=self.name, indices_from_pool=PoolName.KV)
        return PoolTransfer(
            name=self.name,
            keys=["__placeholder__"] * self.window,
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )


KINDS = {
    "swa": Kind(PoolName.SWA, h.mha_pool, lambda _kv: h.mha_pool(pages=40), 3),
    "mamba": Kind(PoolName.MAMBA, h.mha_pool, _mamba_pool, 1),
    "indexer": Kind(PoolName.INDEXER, h.mla_pool, _indexer_pool, 0),
    "draft": Kind(PoolName.DRAFT, h.mha_pool, lambda _kv: h.mha_pool(), 0),
    "draft_indexer": Kind(
        PoolName.DRAFT_INDEXER, h.mla_pool, lambda kv: _indexer_pool(kv, PoolName.DRAFT_INDEXER), 0
    ),
    # an MTP draft's sliding window on the target's full-KV slots (SGLang's _mtp_swa_sidecar_specs)
    "draft_swa": Kind(PoolName.DRAFT_SWA, h.mha_pool, lambda _kv: h.mha_pool(), 0),
}


# ----------------------------------------------------------------------- bytes of pages


def _ranges(pool: Any, slots: torch.Tensor) -> list[tuple[int, int]]:
    pointers, sizes = pool.get_page_buffer_meta(slots)
    return list(zip(pointers, sizes, strict=True))


def _fill(pool: Any, slots: torch.Tensor, seed: int) -> None:
    """Random bytes in every range of the pages at ``slots``."""
    rng = np.random.default_rng(seed)
    for pointer, size in _ranges(pool, slots):
        ctypes.memmove(pointer, rng.bytes(size), size)


def _bytes(pool: Any, slots: torch.Tensor) -> list[bytes]:
    return [ctypes.string_at(pointer, size) for pointer, size in _ranges(pool, slots)]


def _wipe(*pools: Any) -> None:
    """Drop the host copies: only L3 has the pages then."""
    for pool in pools:
        whole = getattr(pool, "kv_buffer", None)
        for buffer in [whole] if isinstance(whole, torch.Tensor) else pool.get_hybrid_pool_buffer():
            buffer.zero_()


# ------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("kind", list(KINDS.values()), ids=list(KINDS))
def test_each_sidecar_pool_round_trips_its_bytes(cluster: Cluster, kind: Kind) -> None:
    kv = kind.kv()
    pool = kind.build(kv)
    mla = kind.kv is h.mla_pool
    cc = _controller(cluster, kv, {kind.name: pool}, mla=mla)
    try:
        keys_before = cluster.stats().keys
        tokens = h.tokens_for(PAGES)
        source = kv.alloc(len(tokens))
        h.fill(kv, source, seed=1)
        transfer = kind.backup_transfer(pool, h.page_hashes(tokens), seed=2)
        if not kind.window:  # the pool's pages sit on the KV pages' slots
            _fill(pool, source, seed=2)
        expected_kv = h.pages_of(kv, source)
        expected = _bytes(pool, source if not kind.window else transfer.host_indices)
        assert h.backup(cc, source, tokens, extra_pools=[transfer]) == len(tokens)
        # every object under a key of its own: the KV's (one or two per page), the pool's
        kv_objects = PAGES * (1 if mla else 2)
        assert cluster.stats().keys - keys_before == kv_objects + len(expected)
        kv.free(source)
        _wipe(kv, pool)

        wanted = kind.prefetch_transfer()
        result = h.prefetch(cc, f"req-{kind.name}", tokens, extra_pools=[wanted])
        assert result.hit_tokens == len(tokens)
        assert result.completed_tokens == len(tokens)
        assert h.pages_of(kv, result.host_indices) == expected_kv
        restored = result.host_indices if not kind.window else wanted.host_indices
        assert _bytes(pool, restored) == expected
        stats = cc.storage_backend.sidecar_stats
        assert (stats.pages_read, stats.pages_missed) == (kind.window or PAGES, 0)
        h.release(cc, result)
    finally:
        cc.detach_storage_backend()


def _controller(
    cluster: Cluster, kv: Any, sidecars: dict[PoolName, Any], *, mla: bool = False, **settings: Any
) -> Any:
    """A controller over ``kv`` and ``sidecars``, each test's pages under a model of its own."""
    fast = {"rpc_timeout": 0.5, "breaker_cooldown": 0.5}
    extra = h.dynamic({"master": cluster.master_endpoint, **fast, **settings})
    return h.controller(kv, "dynamic", extra, f"hybrid/m{next(_MODELS)}", sidecars, mla=mla)


@pytest.mark.parametrize("kind", [KINDS["swa"], KINDS["mamba"]], ids=["swa", "mamba"])
def test_a_partial_hit_restores_the_prefix_sglang_itself_would(
    cluster: Cluster, kind: Kind, tmp_path: Path
) -> None:
    # Two nodes (pages 0-5 and 6-9) are backed up, each with its trailing window; then a KV
    # page of the second node is lost. Of the 8 leading KV pages, only the prefix ending at
    # the first node's boundary has its window: 6 pages are restorable, not 8. SGLang's own
    # file backend, under the same controller, is the reference.
    first = 6
    hits = {}
    for backend in ("kvconnect", "file"):
        kv = kind.kv()
        pool = kind.build(kv)
        if backend == "file":
            extra = {"file_storage_path": str(tmp_path)}
            cc = h.controller(kv, "file", extra, sidecars={kind.name: pool})
        else:
            cc = _controller(cluster, kv, {kind.name: pool})
        try:
            tokens = h.tokens_for(PAGES)
            hashes = h.page_hashes(tokens)
            source = kv.alloc(len(tokens))
            h.fill(kv, source, seed=1)
            windows = []
            for start, end in ((0, first), (first, PAGES)):
                transfer = kind.backup_transfer(pool, hashes[:end], seed=end)
                windows.append(_bytes(pool, transfer.host_indices))
                span = slice(start * h.PAGE, end * h.PAGE)
                done = h.backup(cc, source[span], tokens[span], hashes[start:end], [transfer])
                assert done == (end - start) * h.PAGE
            expected_kv = h.pages_of(kv, source[: first * h.PAGE])
            _lose_kv_page(cc.storage_backend, hashes[8])
            kv.free(source)
            _wipe(kv, pool)

            wanted = kind.prefetch_transfer()
            result = h.prefetch(cc, f"req-{backend}", tokens, extra_pools=[wanted])
            assert result.pool_hits is not None
            read = result.pool_hits[kind.name]  # the window's pages
            hits[backend] = (result.hit_tokens, result.completed_tokens, read)
            assert h.pages_of(kv, result.host_indices) == expected_kv
            assert _bytes(pool, wanted.host_indices) == windows[0]
            h.release(cc, result)
        finally:
            cc.detach_storage_backend()
    assert hits["kvconnect"] == (first * h.PAGE, first * h.PAGE, kind.window)
    assert hits["kvconnect"] == hits["file"]


def _lose_kv_page(backend: Any, page_hash: str) -> None:
    """Remove one object of a stored KV page, behind the backend's back."""
    if isinstance(backend, KVConnectStore):
        key = backend._require_keys().keys([page_hash])[0]
        assert backend._client.remove(key) is Code.OK
    else:  # SGLang's file backend: one file per page
        os.remove(os.path.join(backend.file_path, backend._get_component_key(page_hash) + ".bin"))


def test_a_sidecar_write_that_cannot_be_stopped_keeps_its_slots_from_reuse(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind = KINDS["swa"]
    kv, pool = h.mha_pool(pages=40), h.mha_pool(pages=8)
    cc = _controller(cluster, kv, {kind.name: pool}, write_timeout=1.0)
    sidecars = cc.storage_backend._sidecars
    held = h.HeldCopies(monkeypatch)
    try:
        tokens = h.tokens_for(4, seed=31)
        source = kv.alloc(len(tokens))
        h.fill(kv, source, seed=31)
        transfer = kind.backup_transfer(pool, h.page_hashes(tokens), seed=32)
        window = transfer.host_indices
        held.hold_pages(pool, window)
        assert h.backup(cc, source, tokens, extra_pools=[transfer]) == len(tokens), "KV written"
        assert (sidecars.stats.pages_write_failed, sidecars.stats.pages_withheld) == (3, 3)
        pool.free(window)  # SGLang evicts the window from host memory ...
        pool.clear()  # ... or flushes the whole host cache
        other = pool.alloc(pool.available_size())
        assert not set(other.tolist()) & set(window.tolist()), "a transport still reads them"
        held.let_go.set()
        wait_for(lambda: pool.available_size() == len(window), "withheld slots never came back")
        assert sorted(pool.alloc(len(window)).tolist()) == sorted(window.tolist())
    finally:
        held.let_go.set()
        cc.detach_storage_backend()


def test_a_dead_store_gives_sidecar_misses_not_errors() -> None:
    kind = KINDS["mamba"]
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        kv = h.mha_pool(pages=40)
        pool = kind.build(kv)
        cc = _controller(cluster, kv, {kind.name: pool})
        backend = cc.storage_backend
        try:
            tokens = h.tokens_for(4, seed=41)
            hashes = h.page_hashes(tokens)
            source = kv.alloc(len(tokens))
            transfer = kind.backup_transfer(pool, hashes, seed=42)
            assert h.backup(cc, source, tokens, extra_pools=[transfer]) == len(tokens)
            cluster.master.kill()
            result = h.prefetch(cc, "req-down", tokens, extra_pools=[kind.prefetch_transfer()])
            assert result.hit_tokens == 0
            again = PoolTransfer(
                name=kind.name, host_indices=transfer.host_indices, keys=hashes[-1:]
            )
            assert backend.batch_get_v2([again]) == {kind.name: [False]}
            assert backend.batch_set_v2([again]) == {kind.name: [False]}
            wait_for(lambda: backend.local_only, "the breaker never opened")
            query = backend.batch_exists_v2(hashes, [kind.prefetch_transfer()])
            assert (query.kv_hit_pages, query.restorable_prefix_pages) == (0, [])
            assert backend.stats.errors == 0, "store trouble is not an unexpected error"
        finally:
            cc.detach_storage_backend()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_rank_sharded_pools_keep_their_own_bytes_and_shared_pools_one_copy(
    cluster: Cluster, mla: bool
) -> None:
    # Two TP ranks of one model. The Mamba state is TP-sharded on every model; the second pool
    # is an MLA model's indexer (one copy for all ranks, written by rank 0) or an MHA model's
    # draft KV (each rank its own heads).
    other = PoolName.INDEXER if mla else PoolName.DRAFT
    kvs = [h.mla_pool() if mla else h.mha_pool() for _ in range(2)]
    namespace = f"hybrid-ranks-{mla}"
    backends = [
        KVConnectStore(h.rank_storage(cluster.master_endpoint, rank, mla, namespace=namespace), kv)
        for rank, kv in enumerate(kvs)
    ]
    try:
        hashes = h.page_hashes(h.tokens_for(4, seed=51))
        pools = []
        expected = []  # per rank: its state's bytes, its second pool's
        for rank, (backend, kv) in enumerate(zip(backends, kvs, strict=True)):
            state, second = _mamba_pool(kv), _indexer_pool(kv) if mla else h.mha_pool()
            backend.register_mem_host_pool_v2(state, PoolName.MAMBA)
            backend.register_mem_host_pool_v2(second, other)
            transfers = _rank_transfers(state, second, other, kv.alloc(4 * h.PAGE), hashes)
            _fill(state, transfers[0].host_indices, seed=60 + rank)
            _fill(second, transfers[1].host_indices, seed=70 + rank)
            pools.append((state, second, transfers))
            expected.append(
                [_bytes(p, t.host_indices) for p, t in zip((state, second), transfers, strict=True)]
            )
            before = cluster.stats().keys
            assert backend.batch_set_v2(transfers) == {PoolName.MAMBA: [True], other: [True] * 4}
            shared_objects = 4 if rank == 0 else 0  # rank 1 leaves the shared copy to rank 0
            assert cluster.stats().keys - before == 3 + (shared_objects if mla else 8)
        for rank, (backend, (state, second, transfers)) in enumerate(
            zip(backends, pools, strict=True)
        ):
            _wipe(state, second)
            assert backend.batch_get_v2(transfers) == {PoolName.MAMBA: [True], other: [True] * 4}
            assert _bytes(state, transfers[0].host_indices) == expected[rank][0]
            source = 0 if mla else rank  # MLA: every rank reads rank 0's one copy
            assert _bytes(second, transfers[1].host_indices) == expected[source][1]
        assert expected[0][0] != expected[1][0]
    finally:
        for backend in backends:
            backend.close()


def _rank_transfers(
    state: Any, second: Any, other: PoolName, kv_slots: torch.Tensor, hashes: list[str]
) -> list[PoolTransfer]:
    """A node's Mamba state (its last page's) and a KV-indexed pool's pages, as the controller
    hands them to ``batch_set_v2``/``batch_get_v2``."""
    return [
        PoolTransfer(
            name=PoolName.MAMBA,
            host_indices=state.alloc(1),
            keys=hashes[-1:],
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        ),
        PoolTransfer(name=other, host_indices=kv_slots, keys=hashes),
    ]


@pytest.mark.usefixtures("plugins_loaded")
def test_a_non_writer_rank_of_an_mla_model_backs_up_its_rank_sharded_draft(
    cluster: Cluster,
) -> None:
    # An MLA model with an MHA-shaped draft (each rank its own heads) and DSA indexer keys
    # (one copy for all ranks). On a rank that is not the storage writer SGLang's controller
    # backs up the draft only for its mooncake backend by itself; kvconnect's plugin adds its
    # own rank-sharded pools, and leaves the shared ones to the writer.
    kv = h.mla_pool()
    sidecars = {PoolName.DRAFT: h.mha_pool(), PoolName.INDEXER: _indexer_pool(kv)}
    cc = _controller(cluster, kv, sidecars, mla=True)
    try:
        # SGLang's view of TP rank 1 of 2 (this process plays the only rank)
        cc.storage_config = dataclasses.replace(cc.storage_config, tp_rank=1, tp_size=2)
        assert cc.backup_skip

        def backs_up(name: PoolName) -> bool:
            return bool(cc.should_backup(PoolTransfer(name=name, keys=["h"])))

        assert backs_up(PoolName.DRAFT)
        assert not backs_up(PoolName.INDEXER)
    finally:
        cc.detach_storage_backend()
