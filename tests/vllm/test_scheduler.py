"""The connector's scheduler side through vLLM's real Scheduler (no model, no workers: the
tests report what workers would). Prefill and decode schedulers run in this process and talk
over the real side channel."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from vllm.v1.request import RequestStatus

from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster
from kvconnect.vllm import messages as msg
from kvconnect.vllm.connector import KVConnectHandshake
from kvconnect.vllm.layout import LayerLayout, RankLayout
from kvconnect.vllm.pool import PoolKeys, pool_keys
from kvconnect.vllm.sidechannel import SideChannelClient
from kvconnect.vllm.worker import ConnectorWorker
from tests.support.waiting import wait_for
from tests.vllm.harness import (
    BLOCK,
    FORMAT,
    assert_empty,
    handshake,
    kv_worker,
    make_request,
    make_scheduler,
    plan_of,
    settle_lookups,
    step,
)

PROMPT = list(range(10, 50))  # 40 tokens: 2 full blocks and a partial one
DECODE = {"do_remote_decode": True}


@pytest.fixture
def client() -> Iterator[SideChannelClient]:
    c = SideChannelClient(timeout=2.0, token=os.environ["KVCONNECT_TOKEN"])
    yield c
    c.close()


def _prefill(model: Path, lease: float = 30.0) -> Any:
    return make_scheduler(model, "kv_producer", {"lease": lease}, engine_id="prefill-engine")


def _decode(model: Path, policy: str = "fail") -> Any:
    return make_scheduler(model, "kv_consumer", {"lease": 30.0}, policy=policy)


def _prefill_once(p: Any, rid: str = "p1") -> dict[str, Any]:
    """Run a prefill-only request on ``p``; returns the kv_transfer_params it hands out."""
    p.add_request(make_request(rid, PROMPT, max_tokens=1, params=dict(DECODE)))
    _, outputs = step(p)
    out = outputs[rid]
    assert out.finish_reason is not None
    params: dict[str, Any] = out.kv_transfer_params
    assert params["do_remote_prefill"] is True
    assert params["remote_request_id"] == rid
    assert params["remote_engine_id"] == "prefill-engine"
    assert len(params["remote_block_ids"][0]) == 3  # 40 tokens in blocks of 16
    assert rid in p.requests, "prefill must keep the request's blocks for decode"
    return params


@pytest.fixture
def p_worker() -> Iterator[ConnectorWorker]:
    """Prefill's worker side: it, not the test, decides when held blocks are sent."""
    with kv_worker() as (worker, _):
        yield worker


def _released(p: Any, worker: ConnectorWorker, rid: str, timeout: float = 5.0) -> None:
    """Step ``p`` with its real worker side until vLLM frees ``rid``; check all is free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        step(p, worker=worker)
        if rid not in p.requests:
            assert_empty(p)
            return
        time.sleep(0.05)
    raise AssertionError(f"prefill never released {rid}")


def test_remote_prefill_then_decode(
    tiny_config: Path, client: SideChannelClient, p_worker: ConnectorWorker
) -> None:
    p, d = _prefill(tiny_config), _decode(tiny_config)
    try:
        params = _prefill_once(p)
        d.add_request(make_request("d1", PROMPT, max_tokens=3, params=params))
        output, _ = step(d)
        assert d.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        (job,) = plan_of(output).recv
        assert job.remote_blocks == (tuple(params["remote_block_ids"][0]),)
        assert len(job.local_blocks[0]) == 3
        assert output.num_scheduled_tokens == {}, "nothing runs before the KV is in"
        assert plan_of(output).idle, "the workers may wait for their reads in this step"
        # What decode's worker does after its read: confirm, and prefill lets go.
        endpoint = f"tcp://{params['remote_host']}:{params['remote_port']}"
        reply = client.call(endpoint, msg.Confirm(params["remote_request_id"], 0))
        assert reply == msg.Ack(True)
        _released(p, p_worker, "p1")
        output, _ = step(d, recving=["d1"])
        output, _ = step(d)
        assert output.num_scheduled_tokens == {"d1": 1}, "only the last token is recomputed"
        assert not plan_of(output).idle
        for _ in range(4):
            step(d)
        assert_empty(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_lapsed_lease_frees_prefill_blocks_and_refuses_late_reads(
    tiny_config: Path, client: SideChannelClient, p_worker: ConnectorWorker
) -> None:
    p = _prefill(tiny_config, lease=0.3)
    try:
        params = _prefill_once(p)
        _released(p, p_worker, "p1")  # decode never came: the lease lapsed
        endpoint = f"tcp://{params['remote_host']}:{params['remote_port']}"
        reply = client.call(endpoint, msg.Confirm("p1", 0))
        assert isinstance(reply, msg.Ack)
        assert not reply.ok, "a read confirmed after the release must be refused"
    finally:
        p.shutdown()


def test_decode_aborted_before_loading_frees_prefill_blocks(
    tiny_config: Path, p_worker: ConnectorWorker
) -> None:
    p, d = _prefill(tiny_config), _decode(tiny_config)
    try:
        params = _prefill_once(p)
        d.add_request(make_request("d1", PROMPT, params=params))
        d.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        assert_empty(d)
        _released(p, p_worker, "p1")  # decode told prefill at once, long before the lease
    finally:
        p.shutdown()
        d.shutdown()


def test_decode_aborted_while_loading_waits_for_the_read(tiny_config: Path) -> None:
    p, d = _prefill(tiny_config), _decode(tiny_config)
    try:
        params = _prefill_once(p)
        d.add_request(make_request("d1", PROMPT, params=params))
        step(d)
        d.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        assert "d1" in d.requests, "the blocks being written must stay allocated"
        step(d, recving=["d1"])
        assert_empty(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_full_local_hit_gives_prefill_blocks_back(
    tiny_config: Path, p_worker: ConnectorWorker
) -> None:
    p, d = _prefill(tiny_config), _decode(tiny_config)
    try:
        # Decode computes the prompt itself first, so its prefix cache holds the full blocks.
        d.add_request(make_request("local", [*PROMPT[:32], 99], max_tokens=1))
        step(d)
        step(d)
        params = _prefill_once(p)
        params["remote_num_tokens"] = 32  # prefill's KV covers exactly decode's cached blocks
        d.add_request(make_request("d1", [*PROMPT[:32], 98], max_tokens=1, params=params))
        output, _ = step(d)
        assert not plan_of(output).recv, "nothing to read: every block was cached here"
        _released(p, p_worker, "p1")
        step(d)
        assert_empty(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_partial_local_hit_reads_from_the_first_token_decode_lacks(tiny_config: Path) -> None:
    p, d = _prefill(tiny_config), _decode(tiny_config)
    try:
        d.add_request(make_request("local", [*PROMPT[:32], 99], max_tokens=1))
        step(d)
        step(d)  # decode's prefix cache holds the prompt's first 2 blocks
        params = _prefill_once(p)
        d.add_request(make_request("d1", PROMPT, max_tokens=1, params=params))
        output, _ = step(d)
        (job,) = plan_of(output).recv
        assert job.first_token == 32, "the worker maps tokens from there (any block sizes)"
        assert len(job.local_blocks[0]) == 1, "decode's new block: tokens 32-39"
        held = tuple(params["remote_block_ids"][0])
        assert job.remote_blocks == ((held[2],),), "paired with prefill's block of those tokens"
        assert job.remote.block_ids == (held,), "all of prefill's, from token 0"
        d.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        step(d, recving=["d1"])
        assert_empty(d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_load_failure_follows_the_policy(tiny_config: Path, policy: str) -> None:
    p, d = _prefill(tiny_config), _decode(tiny_config, policy)
    try:
        params = _prefill_once(p)
        d.add_request(make_request("d1", PROMPT, max_tokens=2, params=params))
        output, _ = step(d)
        (job,) = plan_of(output).recv
        output, outputs = step(d, recving=["d1"], failed=["d1"], invalid=job.local_blocks[0])
        if policy == "fail":
            assert outputs["d1"].finish_reason is not None
            assert d.requests.get("d1") is None
        else:
            output, _ = step(d)
            assert output.num_scheduled_tokens == {"d1": len(PROMPT)}, "recomputed in full"
            for _ in range(3):
                step(d)
        assert_empty(d)
    finally:
        p.shutdown()
        d.shutdown()


def _layout() -> RankLayout:
    layer = LayerLayout("l", 1, 0, 1, 0, 64, 4096, 4096)
    return RankLayout("segment", "c0ffee" * 4, (layer, layer), FORMAT.kv_format())


@contextmanager
def _pool_engine(
    tiny_config: Path, fleet_probe: bytes | None = None, **extra: Any
) -> Iterator[tuple[Any, StoreClient, PoolKeys]]:
    """A ``kv_both`` scheduler with the pool on a real store (``extra``: more settings), its
    workers' layout handed over (its fleet probe then runs in the background); a client of
    that store; the pool's key scheme. ``fleet_probe``: what the fleet's probe object already
    holds when the layout arrives (another instance's hash)."""
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        settings = {"pool": True, "master": cluster.master_endpoint, **extra}
        s = make_scheduler(tiny_config, "kv_both", settings)
        store = StoreClient(StoreClientConfig(master=cluster.master_endpoint))
        store.start()
        try:
            layout = _layout()
            keys = pool_keys(namespace="", model=layout.format.model, compat=layout.compat)
            if fleet_probe is not None:
                assert store.put(keys.probe_key, fleet_probe).name == "OK"
            s.connector.set_xfer_handshake_metadata(
                {0: KVConnectHandshake(msgspec.msgpack.encode(layout))}
            )
            yield s, store, keys
        finally:
            store.close()
            s.shutdown()


def test_shared_pool_hit_loads_the_prefix_and_saves_the_rest(tiny_config: Path) -> None:
    with _pool_engine(tiny_config) as (s, store, keys):
        prompt = list(range(100, 156))  # 3 full blocks and 8 tokens
        probe = make_request("probe", prompt)
        for block_hash in probe.block_hashes[:2]:  # the pool has the first two blocks
            assert store.put(keys.block_key(block_hash.hex()), b"x" * 64).name == "OK"

        s.add_request(make_request("hit", prompt, max_tokens=1))
        output, _ = step(s)
        # The lookup runs in the background: vLLM skips the request, the scheduler thread
        # goes on, and the next step after the answer came in schedules the load.
        assert output.num_scheduled_tokens == {}, "scheduled before the lookup answered"
        assert not plan_of(output).load
        settle_lookups(s)
        output, _ = step(s)
        (load,) = plan_of(output).load
        assert load.hashes == tuple(h.hex() for h in probe.block_hashes[:2])
        assert len(load.blocks[0]) == 2
        step(s, recving=["hit"])
        output, _ = step(s)
        assert output.num_scheduled_tokens == {"hit": len(prompt) - 2 * BLOCK}
        (save,) = plan_of(output).save  # the block the pool lacked, once computed
        assert save.hashes == (probe.block_hashes[2].hex(),)
        step(s)
        assert "hit" in s.requests, "the save holds the blocks"
        step(s, sending=["hit"])
        assert_empty(s)

        s.add_request(make_request("miss", list(range(200, 240)), max_tokens=1))
        step(s)
        settle_lookups(s)
        output, _ = step(s)
        assert not plan_of(output).load
        assert output.num_scheduled_tokens == {"miss": 40}
        assert len(plan_of(output).save[0].hashes) == 2
        step(s, sending=["miss"])
        assert_empty(s)


def test_a_fleet_whose_block_hashes_differ_refuses_the_pool_with_one_error(
    tiny_config: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An instance seeded unlike the fleet (the probe object holds another hash of the fixed
    probe block) would never hit: it logs one ERROR, looks nothing up and saves nothing."""
    with _pool_engine(tiny_config, fleet_probe=b"another fleet's seed") as (s, store, keys):
        prompts = {"a": list(range(100, 156)), "b": list(range(200, 256))}
        for prompt in prompts.values():
            for block_hash in make_request("probe", prompt).block_hashes:
                assert store.put(keys.block_key(block_hash.hex()), b"x" * 64).name == "OK"
        for rid, prompt in prompts.items():
            s.add_request(make_request(rid, prompt, max_tokens=1))
            step(s)
            settle_lookups(s)
            output, _ = step(s)
            assert output.num_scheduled_tokens == {rid: len(prompt)}, "a hit"
            assert not plan_of(output).load
            assert not plan_of(output).save, "saved under another fleet's keys"
            while s.requests:
                step(s)
        refusals = [r for r in caplog.records if "pool refused" in r.getMessage()]
        assert [r.levelname for r in refusals] == ["ERROR"]
        assert_empty(s)


def test_a_finished_requests_output_blocks_are_saved_with_pool_save_generated(
    tiny_config: Path,
) -> None:
    """Multi-turn: with ``pool_save_generated`` the full blocks of the output (whose KV was
    computed) are saved once the request finished, and its blocks wait for that save."""
    with _pool_engine(tiny_config, pool_save_generated=True) as (s, _, _):
        request = make_request("chat", PROMPT, max_tokens=30)  # 40 + 30 tokens
        s.add_request(request)
        step(s)
        settle_lookups(s)
        output, _ = step(s)
        (prompt_save,) = plan_of(output).save
        assert prompt_save.hashes == tuple(h.hex() for h in request.block_hashes[:2])
        saves = []
        while request.status is not RequestStatus.FINISHED_LENGTH_CAPPED:
            output, _ = step(s, sending=[])
            saves += plan_of(output).save
        assert saves == [], "saved before the request finished"
        output, _ = step(s)
        (output_save,) = plan_of(output).save
        # 69 tokens have KV (the last sampled one has none yet): 4 full blocks of 16.
        assert output_save.hashes == tuple(h.hex() for h in request.block_hashes[2:4])
        blocks = s.kv_cache_manager.get_block_ids("chat")[0]
        assert output_save.blocks == (tuple(blocks[2:4]),), "the full group's blocks 2, 3"
        assert "chat" in s.requests, "the output's save holds the blocks"
        step(s, sending=["chat"])
        assert_empty(s)


def test_a_second_instance_loads_the_pooled_prefix_byte_for_byte(tiny_config: Path) -> None:
    """Real schedulers and real worker sides on two instances sharing a store: the first
    saves the prompt's blocks, the second is skipped while its lookup runs, then loads them
    (the KV it gets equals the first instance's) and computes only the rest."""
    prompt = list(range(300, 356))  # 3 full blocks and 8 tokens
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        extra = {"pool": True, "master": cluster.master_endpoint}
        first, second = (make_scheduler(tiny_config, "kv_both", extra) for _ in range(2))
        try:
            with (
                kv_worker(seed=3, extra=extra) as (w1, caches1),
                kv_worker(extra=extra) as (w2, caches2),
            ):
                handshake(first, w1)
                handshake(second, w2)
                first.add_request(make_request("a", prompt, max_tokens=1))
                saved = []
                while first.requests:
                    output, _ = step(first, worker=w1)
                    saved += plan_of(output).save
                    settle_lookups(first)
                (save,) = saved
                second.add_request(make_request("b", prompt, max_tokens=1))
                output, _ = step(second, worker=w2)
                assert output.num_scheduled_tokens == {}, "scheduled before the lookup answered"
                settle_lookups(second)
                loads, computed = [], {}

                def drained() -> bool:  # a full hit leaves nothing to save: nothing held
                    output, _ = step(second, worker=w2)
                    loads.extend(plan_of(output).load)
                    computed.update(output.num_scheduled_tokens)
                    return not second.requests

                wait_for(drained, "the second instance's request never ended")
                (load,) = loads
                assert load.hashes == save.hashes
                assert computed == {"b": len(prompt) - 3 * BLOCK}, "the pooled prefix recomputed"
                for name in caches1:
                    for mine, theirs in zip(load.blocks, save.blocks, strict=True):
                        assert torch.equal(caches2[name][:, mine], caches1[name][:, theirs])
            assert_empty(first)
            assert_empty(second)
        finally:
            first.shutdown()
            second.shutdown()
