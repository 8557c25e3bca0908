"""Host layouts and parallelism: ``page_head`` pages shared by instances of different TP sizes.

Each instance's ranks run SGLang's real cache controller over a real ``page_head`` MHA host pool
holding that rank's share of the heads, built as that rank, so SGLang itself derives the storage
configuration (``tp_lcm_size``, ``should_split_heads``) from the extra-config.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.runtime_context import get_parallel

from kvconnect.errors import ConfigError
from kvconnect.sglang.backend import KVConnectStore
from kvconnect.sglang.plugin import DYNAMIC_ROUTE
from kvconnect.store.launch import Cluster
from tests.sglang import harness as h

pytestmark = [pytest.mark.integration, pytest.mark.sglang]

HEADS = 4  # KV heads of the model; a TP-2 rank holds 2
LCM = 2  # tp_lcm_size: the TP sizes 1 and 2 share pages


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(servers=1, server_size=16 << 20) as c:
        yield c


def as_rank(rank: int, tp_size: int) -> AbstractContextManager[Any]:
    """Code inside runs as TP rank ``rank`` of ``tp_size`` (SGLang reads it when it builds a
    controller's storage configuration and when its threads run)."""
    return get_parallel().override(tp_rank=rank, tp_size=tp_size)


@contextmanager
def instance(cluster: Cluster, tp_size: int, namespace: str) -> Iterator[list[Any]]:
    """The controllers of one SGLang instance's ``tp_size`` ranks, kvconnect attached."""
    extra = {**DYNAMIC_ROUTE, "tp_lcm_size": LCM, "master": cluster.master_endpoint}
    controllers: list[HybridCacheController] = []
    try:
        for rank in range(tp_size):
            with as_rank(rank, tp_size):
                pool = h.mha_pool("page_head", pages=32, heads=HEADS // tp_size)
                controllers.append(h.controller(pool, "dynamic", {**extra, "namespace": namespace}))
        yield controllers
    finally:
        for cc in controllers:
            cc.detach_storage_backend()


def heads_of(pool: Any, host_indices: torch.Tensor, first: int, count: int) -> list[bytes]:
    """Bytes of heads ``first`` to ``first + count`` of each page (its K, then its V), laid out
    as a pool of only those heads holds them."""
    pages = []
    for start in range(0, len(host_indices), h.PAGE):
        page = pool.get_data_page(int(host_indices[start]), flat=False)  # (2, 1, H, page, L, D)
        shard = page[:, :, first : first + count].contiguous()
        pages.append(shard.view(torch.uint8).numpy().tobytes())
    return pages


def test_tp2_ranks_read_the_head_shards_a_tp1_instance_wrote(cluster: Cluster) -> None:
    tokens = h.tokens_for(6, seed=21)
    with (
        instance(cluster, 1, "tp1-writes") as (writer,),
        instance(cluster, 2, "tp1-writes") as ranks,
    ):
        assert writer.storage_config.should_split_heads, "SGLang splits the TP-1 pages"
        pool = writer.storage_host_pool
        source = pool.alloc(len(tokens))
        h.fill(pool, source, seed=21)
        with as_rank(0, 1):
            assert h.backup(writer, source, tokens) == len(tokens)
        for rank, cc in enumerate(ranks):
            assert not cc.storage_config.should_split_heads, "a TP-2 rank holds one shard"
            with as_rank(rank, 2):
                result = h.prefetch(cc, f"tp2-rank{rank}", tokens)
            assert result.completed_tokens == len(tokens)
            got = h.pages_of(cc.storage_host_pool, result.host_indices)
            assert got == heads_of(pool, source, rank * HEADS // 2, HEADS // 2)
            h.release(cc, result)


def test_a_tp1_instance_reads_a_page_once_every_tp2_rank_wrote_its_shard(cluster: Cluster) -> None:
    tokens = h.tokens_for(5, seed=22)
    hashes = h.page_hashes(tokens)
    with (
        instance(cluster, 2, "tp2-writes") as ranks,
        instance(cluster, 1, "tp2-writes") as (reader,),
    ):
        sources = []
        for rank, cc in enumerate(ranks):
            source = cc.storage_host_pool.alloc(len(tokens))
            h.fill(cc.storage_host_pool, source, seed=220 + rank)
            sources.append(source)
            with as_rank(rank, 2):
                assert h.backup(cc, source, tokens) == len(tokens)
            with as_rank(0, 1):
                found = reader.storage_backend.batch_exists(hashes)
            assert found == (len(hashes) if rank == 1 else 0), "a page needs every shard"
        with as_rank(0, 1):
            result = h.prefetch(reader, "tp1", tokens)
        assert result.completed_tokens == len(tokens)
        pool = reader.storage_host_pool
        for rank, (cc, source) in enumerate(zip(ranks, sources, strict=True)):
            shard = heads_of(pool, result.host_indices, rank * HEADS // 2, HEADS // 2)
            assert shard == h.pages_of(cc.storage_host_pool, source)
        h.release(reader, result)


def test_a_tp_lcm_size_that_does_not_divide_the_heads_is_refused_at_attach(
    cluster: Cluster,
) -> None:
    storage = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="lcm/model",
        tp_lcm_size=2,
        should_split_heads=True,
        extra_config={"master": cluster.master_endpoint},
    )
    with pytest.raises(ConfigError, match="3 KV heads into 2 shards"):
        KVConnectStore(storage, h.mha_pool("page_head", pages=8, heads=3)).close()
