"""The pool's KV-event bookkeeping (pure) and the removal poller against a real store master."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from kvconnect._config import MiB
from kvconnect.errors import KVConnectError
from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster
from kvconnect.store.master.removals import REMOVAL_LOG
from kvconnect.store.messages import Code
from kvconnect.testing.peer import pattern
from kvconnect.vllm import events as ev
from kvconnect.vllm.events import PoolEvents, RemovalPoller, RemovedBlocks, StoredBlock
from kvconnect.vllm.pool import pool_keys
from tests.support.waiting import wait_for


def _hashes(count: int) -> list[bytes]:
    return [hashlib.sha256(bytes([i])).digest() for i in range(count)]


def test_a_block_is_announced_once_every_rank_saved_it() -> None:
    hashes = _hashes(3)
    tokens = list(range(100, 148))
    events = PoolEvents(ranks=2)
    saved = [h.hex() for h in hashes[1:]]
    events.planned(ev.stored_blocks(hashes, tokens, 16, saved, (7, "adapter")))
    events.saved(saved)
    assert events.take() == [], "one rank of two saved: not in the pool yet"
    events.saved(saved[:1])
    assert events.take() == [
        StoredBlock(saved[0], hashes[0].hex(), tuple(range(116, 132)), 7, "adapter")
    ]
    events.saved(saved[1:])
    assert events.take() == [StoredBlock(saved[1], saved[0], tuple(range(132, 148)), 7, "adapter")]


def test_only_announced_blocks_are_withdrawn_and_only_once() -> None:
    events = PoolEvents(ranks=1)
    events.saved(["aa", "bb"])  # never planned: announced without tokens
    assert events.take() == [StoredBlock("aa", None, ()), StoredBlock("bb", None, ())]
    events.removed(["bb", "cc", "bb"])  # every object of a block may be reported
    events.removed(["bb"])
    assert events.take() == [RemovedBlocks(("bb",))]
    events.saved(["bb"])
    events.removed(["bb"])
    assert events.take() == [StoredBlock("bb", None, ()), RemovedBlocks(("bb",))]


def test_the_tables_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ev, "TRACKED", 4)
    events = PoolEvents(ranks=2)
    events.planned(StoredBlock(f"{i:02x}", None, (i,)) for i in range(10))
    for i in range(10):  # both ranks save each block in turn
        events.saved([f"{i:02x}", f"{i:02x}"])
    events.saved(f"{i:02x}" for i in range(10, 20))  # one rank saved: partial entries
    taken = events.take()
    assert [b.block_hash for b in taken if isinstance(b, StoredBlock) and b.token_ids] == [
        f"{i:02x}" for i in range(6, 10)
    ], "the oldest planned entries were forgotten; their blocks have no tokens"
    assert len(events._announced) == 4
    assert len(events._copies) == 4
    assert len(events._planned) == 0


def test_stored_blocks_of_a_save_that_is_not_the_requests() -> None:
    hashes = _hashes(2)
    assert ev.stored_blocks(hashes, [1] * 32, 16, ["ff"]) == [StoredBlock("ff", None, ())]
    assert ev.stored_blocks(hashes, [1] * 32, 16, []) == []


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(servers=1, server_size=16 * MiB) as c:
        yield c


@pytest.mark.integration
def test_the_poller_maps_removed_objects_to_blocks(cluster: Cluster) -> None:
    scheme = pool_keys(namespace="t", model="m/x", compat="c" * 32)
    client = StoreClient(StoreClientConfig(master=cluster.master_endpoint, rpc_timeout=2.0))
    client.start()
    events = PoolEvents(ranks=2)
    poller = RemovalPoller(client, lambda: scheme, events.removed, interval=0.05)
    try:
        blocks = ["ab" * 32, "cd" * 32]
        keys = [scheme.block_key(block, group) for block in blocks for group in range(2)]
        other = ["t/vllm/other-model/" + "x" * 32 + "/" + "ef" * 32 + "/g0"]
        region = client.register(bytearray(pattern(5, 4096 * len(keys + other)).tobytes()))
        offsets = [4096 * i for i in range(len(keys + other))]
        assert all(client.batch_put_from(keys + other, region, offsets, [4096] * 5).ok())
        events.saved(blocks * 2)  # both ranks saved both blocks
        assert len(events.take()) == 2
        poller.poll()  # first contact: the log's start (nothing of ours removed yet)
        poller.start()
        # One group's object is enough: the block is no longer whole in the pool.
        assert client.batch_remove([scheme.block_key(blocks[0], 1)]) == [Code.OK]
        assert client.batch_remove(other) == [Code.OK]
        got: list[ev.PoolEvent] = []
        wait_for(lambda: bool(got.extend(events.take()) or got), "no removal event")
        assert got == [RemovedBlocks((blocks[0],))]
        assert client.batch_remove(keys) == [Code.OK, Code.NOT_FOUND, Code.OK, Code.OK]
        wait_for(lambda: bool(got.extend(events.take()) or len(got) > 1), "no second removal")
        assert got[1:] == [RemovedBlocks((blocks[1],))], "block 0 was withdrawn already"
        assert poller.missed == 0
    finally:
        poller.close()
        client.close()


@pytest.mark.integration
def test_a_poller_that_fell_behind_counts_what_it_missed(cluster: Cluster) -> None:
    scheme = pool_keys(namespace="behind", model="m", compat="d" * 32)
    client = StoreClient(StoreClientConfig(master=cluster.master_endpoint, rpc_timeout=2.0))
    client.start()
    removed: list[str] = []
    poller = RemovalPoller(client, lambda: scheme, removed.extend, interval=60.0)
    try:
        poller.poll()
        region = client.register(bytearray(64))
        # Put and remove more one-byte objects than the ring keeps, then poll once.
        extra = 16
        keys = [scheme.block_key(f"{i:064x}") for i in range(REMOVAL_LOG + extra)]
        for start in range(0, len(keys), 1024):
            chunk = keys[start : start + 1024]
            assert all(
                client.batch_put_from(chunk, region, [0] * len(chunk), [1] * len(chunk)).ok()
            )
            assert client.batch_remove(chunk) == [Code.OK] * len(chunk)
        for _ in range(8):  # drain the ring (16 pages per poll)
            poller.poll()
        assert poller.missed == extra
        assert len(removed) == REMOVAL_LOG
    finally:
        poller.close()
        client.close()


@pytest.mark.integration
def test_the_poller_reads_a_restarted_masters_fresh_log_from_its_start() -> None:
    scheme = pool_keys(namespace="r", model="m", compat="e" * 32)
    blocks = [f"{i:064x}" for i in range(6)]
    keys = [scheme.block_key(block) for block in blocks]
    with Cluster(servers=1, server_size=16 * MiB) as cluster:
        client = StoreClient(StoreClientConfig(master=cluster.master_endpoint, rpc_timeout=0.5))
        client.start()
        events = PoolEvents(ranks=1)
        poller = RemovalPoller(client, lambda: scheme, events.removed, interval=60.0)
        try:
            region = client.register(bytearray(pattern(9, 4096).tobytes()))
            assert all(client.batch_put_from(keys, region, [0] * 6, [4096] * 6).ok())
            events.saved(blocks)
            events.take()
            poller.poll()
            assert client.batch_remove(keys[:5]) == [Code.OK] * 5  # the log is at 5
            poller.poll()
            assert events.take() == [RemovedBlocks(tuple(blocks[:5]))]
            # The store server learns what it holds from the master's journal (a heartbeat).
            wait_for(
                lambda: all(s.backlog == 0 for s in cluster.stats().segments),
                "the store server did not learn of its objects",
            )
            cluster.master.kill()
            cluster.restart_master()
            # The store server mounts again with what it holds: the last key survived.
            wait_for(lambda: _exists(client, keys[5]), "the restarted master lacks the key", 20)
            assert client.batch_remove(keys[5:]) == [Code.OK]  # entry 1 of the new log
            poller.poll()
            assert events.take() == [RemovedBlocks((blocks[5],))]
        finally:
            poller.close()
            client.close()


def _exists(client: StoreClient, key: str) -> bool:
    try:
        return client.exists(key)
    except KVConnectError:
        return False
