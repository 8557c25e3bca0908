"""The master's KV events end to end: a real master (``--master-kv-events``) and store server,
a real client putting and removing vLLM pool keys, the router's subscriber decoding what the
master publishes — stores, removals, evictions, a master restart (the store servers' reports
announce their objects again), lost objects — and hostile replay requests."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
import zmq

from kvconnect._config import MiB, cluster_token, tenant_token
from kvconnect.router.events import EventSubscriber
from kvconnect.store import messages as m
from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.kvevents import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    parse_replay,
    replay_request,
)
from kvconnect.store.launch import Cluster, free_port
from kvconnect.store.messages import Code
from kvconnect.store.rpc import RpcClient
from kvconnect.transfer import TransferConfig
from kvconnect.vllm.pool import pool_keys
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

Hashed = tuple[bytes | int, int | None]
KEYS = pool_keys(namespace="team", model="org/tiny", compat="5eed" * 8)


def _hash(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8  # 32 bytes, as vLLM's sha256 block hashes


class Index:
    """What the master announced: hashes (with their group) held now, applied in order."""

    def __init__(self) -> None:
        self.held: set[Hashed] = set()
        self.cleared = 0
        self.resets = 0
        self.events: list[object] = []
        self._lock = threading.Lock()

    def on_batch(self, name: str, batch: KVEventBatch) -> None:
        with self._lock:
            for event in batch.events:
                self.events.append(event)
                if isinstance(event, BlockStored):
                    assert (event.locality, event.ownership) == ("REMOTE", "kvconnect")
                    self.held.update((h, event.group_idx) for h in event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self.held.difference_update((h, event.group_idx) for h in event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self.held.clear()
                    self.cleared += 1

    def on_reset(self, name: str) -> None:
        self.resets += 1

    def now(self) -> set[Hashed]:
        with self._lock:
            return set(self.held)


@pytest.fixture
def cluster() -> Iterator[tuple[Cluster, str, str]]:
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    args = ["--master-kv-events", events, "--master-kv-events-replay", replay]
    args += ["--master-tenants", json.dumps([{"name": "acme"}])]
    args += ["--master-heartbeat-ttl", "1", "--master-kv-events-buffer", "64"]
    with Cluster(
        servers=1,
        server_size=8 * MiB,
        master_args=args,
        server_args=["--store-heartbeat-interval", "0.2"],
    ) as c:
        yield c, events, replay


def _client(cluster: Cluster, tenant: str = "") -> StoreClient:
    root = cluster_token(None, "", False)
    assert root is not None
    transfer = TransferConfig(token=tenant_token(root, tenant) if tenant else root)
    client = StoreClient(
        StoreClientConfig(master=cluster.master_endpoint, rpc_timeout=2.0), transfer
    )
    client.start()
    return client


def _held(client: StoreClient, keys: dict[str, Hashed]) -> set[Hashed]:
    """The (hash, group) of the keys the store holds now."""
    found = client.batch_exists(list(keys))
    return {value for value, present in zip(keys.values(), found, strict=True) if present}


def _backlog(cluster: Cluster) -> int:
    return sum(segment.backlog for segment in cluster.stats().segments)


def test_stores_removals_evictions_restart_and_loss_are_published(
    cluster: tuple[Cluster, str, str],
) -> None:
    store, events, replay = cluster
    index = Index()
    client = _client(store)
    sub = EventSubscriber("store", events, replay, index.on_batch, on_reset=index.on_reset)
    try:
        sub.start()
        wait_for(lambda: index.cleared == 1, "a master starts with AllBlocksCleared")
        keys: dict[str, Hashed] = {
            KEYS.block_key(_hash(i).hex(), i % 2): (_hash(i), i % 2) for i in range(4)
        }
        for key in keys:
            assert client.put(key, b"kv" * 1000) is Code.OK
        assert client.put("app/blob", b"x" * 100) is Code.OK
        wanted = {*keys.values(), (b"app/blob", None)}
        wait_for(lambda: index.now() == wanted, "every put announced with its hash and group")
        removed = next(iter(keys))
        assert client.remove(removed) is Code.OK
        wanted.discard(keys.pop(removed))
        wait_for(lambda: index.now() == wanted, "a removal withdraws the hash")

        # Fill the 8 MiB server past its watermark: eviction withdraws what it drops (a put
        # may find no room, or BUSY space, while evicted space waits for the server's
        # acknowledgement).
        many = {KEYS.block_key(_hash(100 + i).hex()): (_hash(100 + i), 0) for i in range(24)}
        for key in many:
            assert client.put(key, b"e" * (MiB // 2)) in (Code.OK, Code.NO_SPACE, Code.BUSY)
        wait_for(lambda: store.stats().evictions > 0, "the master evicts")
        every = {**keys, "app/blob": (b"app/blob", None), **many}
        wait_for(lambda: index.now() == _held(client, every), "announced = stored")
        assert not set(many.values()) <= index.now(), "some were evicted"

        # A restarted master announces what the store server reports it holds.
        held_before = index.now()
        assert held_before
        wait_for(lambda: _backlog(store) == 0, "the server learned every object")
        store.master.kill()
        store.restart_master()
        wait_for(lambda: index.resets == 1, "the subscriber sees a new publisher")
        wait_for(lambda: index.cleared == 2, "the new master starts cleared")
        wait_for(lambda: index.now() == held_before, "recovered objects announced again")

        # A store server gone past heartbeat_ttl: its objects are lost, and withdrawn.
        store.servers[0].kill()
        wait_for(lambda: index.now() == set(), "lost objects withdrawn", timeout=15)
    finally:
        sub.close()
        client.close()
    assert sub.stats.decode_errors == 0
    assert sub.stats.skipped_events == 0


def test_a_tenants_objects_are_never_published(cluster: tuple[Cluster, str, str]) -> None:
    """The stream has one audience: a tenant's keys (its pool blocks too) stay off it, stored
    or removed; the cluster's own keys are published around them."""
    store, events, replay = cluster
    index = Index()
    sub = EventSubscriber("store", events, replay, index.on_batch, on_reset=index.on_reset)
    ours = {KEYS.block_key(_hash(i).hex()): (_hash(i), 0) for i in range(2)}
    theirs = [KEYS.block_key(_hash(50 + i).hex()) for i in range(3)] + ["app/secret"]
    try:
        sub.start()
        wait_for(lambda: index.cleared == 1, "a master starts with AllBlocksCleared")
        with _client(store, "acme") as tenant, _client(store) as own:
            for key in theirs:
                assert tenant.put(key, b"t" * 500) is Code.OK
            for key in ours:
                assert own.put(key, b"o" * 500) is Code.OK
            wait_for(lambda: index.now() == set(ours.values()), "the cluster's puts announced")
            for key in theirs:
                assert tenant.remove(key) is Code.OK
            last = next(iter(ours))
            assert own.remove(last) is Code.OK
            wait_for(lambda: index.now() == {ours[k] for k in ours if k != last}, "withdrawn")
        published = [h for e in index.events if hasattr(e, "block_hashes") for h in e.block_hashes]
        assert set(published) == {hashed for hashed, _ in ours.values()}
    finally:
        sub.close()


HOSTILE = [
    [b"garbage"],
    [b"", b"\x00" * 7],
    [b"", b"\x00" * 9],
    [b"", (2**64 - 1).to_bytes(8, "big")],
    [b"", b"\x00" * 8, b"extra"],
    [b"", b"y" * 4096],  # past the replay socket's message size: the peer is disconnected
]


def test_hostile_replay_requests_leave_the_master_serving(
    cluster: tuple[Cluster, str, str],
) -> None:
    store, _events, replay = cluster
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        bad, good = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock in (bad, good):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.connect(replay)
        for hostile in HOSTILE:
            bad.send_multipart(hostile)
        good.send_multipart(replay_request(0))
        answers = []
        while (answer := parse_replay(good.recv_multipart())) is not None:
            if answer[0] == END_SEQ:
                break
            answers.append(answer[0])
        assert answers == [0], "the master's AllBlocksCleared, and the end marker"
        rpc = RpcClient(store.master_endpoint, 2.0, token=cluster_token(None, "", False))
        try:
            assert isinstance(rpc.call(m.Stats()), m.StatsReply), "the master still serves"
        finally:
            rpc.close()
    finally:
        ctx.destroy(linger=0)
