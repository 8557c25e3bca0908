"""Hybrid models (vLLM's hybrid KV-cache allocator kept on): vLLM 0.33's real Scheduler with a
full-attention group plus a sliding-window group (like Gemma 3) or a Mamba group (like
Granite 4), and real worker sides (transfer engines over TCP, a real store for the pool; no
model). Every group's blocks move, byte for byte, and only the blocks a group needs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvconnect.store.launch import Cluster, free_port
from kvconnect.vllm.connector import KVConnectConnector
from kvconnect.vllm.groups import NULL_BLOCK
from kvconnect.vllm.worker import ConnectorWorker
from tests.support.waiting import wait_for
from tests.vllm.harness import (
    FORMAT,
    assert_empty,
    handshake,
    kv_worker,
    layer_groups,
    make_request,
    make_scheduler,
    plan_of,
    settle_lookups,
    step,
)

BLOCKS = 64
PROMPT = list(range(10, 90))  # 80 tokens: 5 blocks; the window (24 tokens) needs the last 2

Engine = tuple[Scheduler, ConnectorWorker, dict[str, torch.Tensor]]


@contextmanager
def _engine(
    model: Path,
    role: str,
    groups: str,
    *,
    seed: int | None,
    engine_id: str | None = None,
    policy: str = "fail",
    extra: Mapping[str, Any] | None = None,
) -> Iterator[Engine]:
    settings = {"lease": 30.0, **(extra or {})}
    scheduler = make_scheduler(
        model, role, settings, engine_id=engine_id, num_blocks=BLOCKS, policy=policy, groups=groups
    )
    try:
        fmt = replace(FORMAT, model=str(model))  # the pool's keys name the model vLLM serves
        with kv_worker(BLOCKS, seed, fmt=fmt, groups=groups, extra=extra) as (worker, caches):
            handshake(scheduler, worker)
            yield scheduler, worker, caches
    finally:
        scheduler.shutdown()


def _block(cache: torch.Tensor, block: int) -> torch.Tensor:
    """One block of a layer: attention layers are ``[K|V, blocks, …]``, Mamba ``[blocks, …]``."""
    return cache[block] if cache.dtype == torch.int8 else cache[:, block]


def _nonzero_blocks(cache: torch.Tensor) -> set[int]:
    return {b for b in range(BLOCKS) if _block(cache, b).any()}


def _step_until(engine: Engine, done: Callable[[], bool], message: str) -> None:
    """Step ``engine`` with its worker until ``done()`` (the worker's transfers run on threads
    of their own: their results show up in a later step)."""
    scheduler, worker, _ = engine

    def stepped() -> bool:
        if done():
            return True
        step(scheduler, worker=worker)
        return False

    wait_for(stepped, message)


def _prefill(engine: Engine, rid: str, prompt: list[int]) -> dict[str, Any]:
    """Run a prefill-only request to its end (a Mamba model's takes two steps: vLLM computes
    its prompt in block-aligned chunks); the kv_transfer_params it hands out."""
    scheduler, worker, _ = engine
    scheduler.add_request(
        make_request(rid, prompt, max_tokens=1, params={"do_remote_decode": True})
    )
    for _ in range(3):
        _, outputs = step(scheduler, worker=worker)
        if rid in outputs and outputs[rid].finish_reason is not None:
            handed: dict[str, Any] = outputs[rid].kv_transfer_params
            return handed
    raise AssertionError(f"{rid} never finished its prefill")


@pytest.mark.parametrize("groups", ["swa", "mamba"])
def test_vllm_keeps_its_hybrid_allocator_on_with_kvconnect(tiny_config: Path, groups: str) -> None:
    assert supports_hma(KVConnectConnector)
    s = make_scheduler(tiny_config, "kv_both", {}, groups=groups)
    try:
        assert s.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert isinstance(s.kv_cache_manager.coordinator, HybridKVCacheCoordinator)
        assert s.connector.get_loaded_kv_cache_group_ids(None) == (0, 1)
    finally:
        s.shutdown()


@pytest.mark.parametrize("groups", ["swa", "mamba"])
def test_pd_moves_every_group_and_only_the_blocks_it_needs(tiny_config: Path, groups: str) -> None:
    with (
        _engine(tiny_config, "kv_producer", groups, seed=1, engine_id="prefill") as prefill,
        _engine(tiny_config, "kv_consumer", groups, seed=None) as decode,
    ):
        (p, _, p_caches), (d, dw, d_caches) = prefill, decode
        params = _prefill(prefill, "p1", list(PROMPT))
        full, second = params["remote_block_ids"]
        assert len(full) == 5
        if groups == "swa":  # vLLM freed the 3 blocks the window left behind
            assert len(second) == 2
            assert params["remote_num_tokens"] == 80
        else:  # the state before the last prompt token: decode computes that token
            assert len(second) == 1
            assert params["remote_num_tokens"] == 79

        d.add_request(make_request("d1", list(PROMPT), max_tokens=3, params=params))
        output, _ = step(d, worker=dw)
        (job,) = plan_of(output).recv
        assert job.remote_blocks == (tuple(full), tuple(second))
        assert [len(ids) for ids in job.local_blocks] == [5, len(second)]
        _step_until(
            decode,
            lambda: d.requests["d1"].status != RequestStatus.WAITING_FOR_REMOTE_KVS,
            "decode never got the KV",
        )
        moved = 0
        for name, cache in d_caches.items():
            group = layer_groups(groups)[name]
            pairs = list(zip(job.local_blocks[group], job.remote_blocks[group], strict=True))
            for local, remote in pairs:
                assert torch.equal(_block(cache, local), _block(p_caches[name], remote)), name
            # nothing else was written: the window's left-behind blocks were not moved
            assert _nonzero_blocks(cache) == set(job.local_blocks[group]), name
            moved += len(pairs) * _block(cache, 0).numel() * cache.element_size()
        assert dw.stats.take()["pd_bytes"] == moved

        output, _ = step(d, worker=dw)
        assert output.num_scheduled_tokens == {"d1": 1}, "decode computes the last token only"
        _step_until(prefill, lambda: not p.requests, "prefill never freed its blocks")
        assert_empty(p)
        _step_until(decode, lambda: not d.requests, "decode never finished")
        assert_empty(d)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("groups", ["swa", "mamba"])
def test_a_failed_hybrid_load_follows_the_policy(
    tiny_config: Path, groups: str, policy: str
) -> None:
    params = {  # a prefill that is gone: nothing listens at its side channel
        "do_remote_prefill": True,
        "remote_block_ids": [[1, 2, 3, 4, 5], [4, 5] if groups == "swa" else [5]],
        "remote_engine_id": "gone",
        "remote_request_id": "p1",
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
        "tp_size": 1,
        "remote_num_tokens": 80,
    }
    fast = {"rpc_timeout": 0.5}  # how long decode waits for the dead side channel
    with _engine(
        tiny_config, "kv_consumer", groups, seed=None, policy=policy, extra=fast
    ) as decode:
        d, dw, _ = decode
        d.add_request(make_request("d1", list(PROMPT), max_tokens=2, params=params))
        output, _ = step(d, worker=dw)
        assert len(plan_of(output).recv) == 1
        request = d.requests["d1"]
        computed: list[tuple[int, int]] = []  # (scheduled, computed after) once it runs

        def ran() -> bool:
            output, _ = step(d, worker=dw)
            if "d1" in output.num_scheduled_tokens:
                computed.append((output.num_scheduled_tokens["d1"], request.num_computed_tokens))
            return request.is_finished() or bool(computed)

        wait_for(ran, "the failed read was never reported")
        if policy == "fail":
            assert request.status == RequestStatus.FINISHED_ERROR
            assert not computed
        else:
            ((scheduled, after),) = computed
            assert scheduled == after, "recomputed from the first token"
            _step_until(decode, lambda: not d.requests, "the recomputed request never finished")
        assert "d1" not in d.requests
        assert_empty(d)


def _looked_up(engine: Any) -> None:
    """One step that starts the new request's pool lookup (vLLM skips the request while it
    runs), then its answer."""
    scheduler, worker, _ = engine
    output, _ = step(scheduler, worker=worker)
    assert output.num_scheduled_tokens == {}, "scheduled before the lookup answered"
    settle_lookups(scheduler)


def test_pool_saves_and_hits_only_what_every_group_can_use(tiny_config: Path) -> None:
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        extra = {"pool": True, "master": cluster.master_endpoint}
        with (
            _engine(tiny_config, "kv_both", "swa", seed=3, extra=extra) as writer,
            _engine(tiny_config, "kv_both", "swa", seed=None, extra=extra) as reader,
        ):
            (w, ww, w_caches), (r, rw, r_caches) = writer, reader
            w.add_request(make_request("a", list(PROMPT), max_tokens=3))
            _looked_up(writer)
            output, _ = step(w, worker=ww)
            (save,) = plan_of(output).save
            assert len(save.hashes) == 5
            full, window = save.blocks
            assert NULL_BLOCK not in full
            assert window[:3] == (NULL_BLOCK,) * 3
            assert NULL_BLOCK not in window[3:]
            output, _ = step(w, worker=ww)
            # vLLM may hand the window's blocks on before the save read them: wait first
            assert plan_of(output).preempted == ("a",)
            _step_until(writer, lambda: not w.requests, "the save never finished")
            assert_empty(w)

            # The same prompt and more: all 5 blocks are a hit (the window's 2 are there).
            r.add_request(make_request("b", list(PROMPT) + list(range(200, 220)), max_tokens=1))
            _looked_up(reader)
            output, _ = step(r, worker=rw)
            (load,) = plan_of(output).load
            assert load.hashes == save.hashes
            assert load.blocks[1][:3] == (NULL_BLOCK,) * 3
            scheduled: list[int] = []

            def computing() -> bool:
                output, _ = step(r, worker=rw)
                scheduled.extend(n for rid, n in output.num_scheduled_tokens.items() if rid == "b")
                return bool(scheduled)

            wait_for(computing, "the load never finished")
            assert scheduled == [20], "the first 80 tokens came from the pool"
            for name, cache in r_caches.items():
                group = layer_groups("swa")[name]
                pairs = [
                    (mine, theirs)
                    for mine, theirs in zip(load.blocks[group], save.blocks[group], strict=True)
                    if mine != NULL_BLOCK
                ]
                assert len(pairs) == (5 if group == 0 else 2)
                for mine, theirs in pairs:
                    assert torch.equal(_block(cache, mine), _block(w_caches[name], theirs))
                assert _nonzero_blocks(cache) == {mine for mine, _ in pairs}, name
            _step_until(reader, lambda: not r.requests, "the reader never finished")
            assert_empty(r)

            # The first 3 blocks are in the pool for full attention, but the window a hit
            # there needs (blocks 1 and 2) is not: no hit, the prompt is computed.
            r.add_request(
                make_request("c", list(PROMPT[:48]) + list(range(300, 310)), max_tokens=1)
            )
            _looked_up(reader)
            output, _ = step(r, worker=rw)
            assert not plan_of(output).load
            assert output.num_scheduled_tokens == {"c": 58}
            _step_until(reader, lambda: not r.requests, "c never finished")
            assert_empty(r)


def test_the_pool_keeps_no_mamba_states(
    tiny_config: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvconnect")
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        extra = {"pool": True, "master": cluster.master_endpoint}
        with _engine(tiny_config, "kv_both", "mamba", seed=1, extra=extra) as engine:
            s, _, _ = engine
            assert "keeps no Mamba states" in caplog.text
            s.add_request(make_request("a", list(PROMPT), max_tokens=1))
            for _ in range(2):  # computed in two block-aligned chunks
                output, _ = step(s, worker=engine[1])
                assert not plan_of(output).load
                assert not plan_of(output).save
            _step_until(engine, lambda: not s.requests, "a never finished")
            assert_empty(s)


def test_a_prefill_with_other_kv_cache_groups_is_computed_locally(tiny_config: Path) -> None:
    params = {  # a full-attention-only prefill (one group), this decode has two
        "do_remote_prefill": True,
        "remote_block_ids": [[1, 2, 3, 4, 5]],
        "remote_engine_id": "other",
        "remote_request_id": "p1",
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
        "tp_size": 1,
        "remote_num_tokens": 80,
    }
    fast = {"rpc_timeout": 0.5}
    with _engine(tiny_config, "kv_consumer", "swa", seed=None, extra=fast) as decode:
        d, dw, _ = decode
        d.add_request(make_request("d1", list(PROMPT), max_tokens=2, params=params))
        output, _ = step(d, worker=dw)
        assert not plan_of(output).recv
        assert output.num_scheduled_tokens == {"d1": 80}
        _step_until(decode, lambda: not d.requests, "d1 never finished")
        assert_empty(d)
