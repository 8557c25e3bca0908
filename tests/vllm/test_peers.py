"""Prefill engines that come and go, seen from decode (no vLLM needed; real side channels,
real transfer engines over TCP, prefill peers in processes of their own): a prefill killed and
replaced at its endpoint is used at once and the dead one's layout, sockets and transfer state
go; repeated replacements leave nothing behind; side-channel calls to a dead endpoint are not
delivered to its successor; leases of a dead prefill's requests stop being renewed."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvconnect.errors import PeerUnreachable
from kvconnect.store.launch import free_port
from kvconnect.vllm import lanes
from kvconnect.vllm import messages as msg
from kvconnect.vllm.config import VllmConnectorConfig
from kvconnect.vllm.layout import IncompatiblePeer, RankLayout
from kvconnect.vllm.pd import LeaseKeeper, PrefillService
from kvconnect.vllm.peers import PeerLayouts, PeerReplaced
from kvconnect.vllm.plan import RecvJob, StepPlan
from kvconnect.vllm.scheduler import ConnectorScheduler
from kvconnect.vllm.sidechannel import SideChannelClient, SideChannelServer
from kvconnect.vllm.worker import ConnectorWorker
from tests.support.leaks import kvconnect_threads, open_fds
from tests.support.prefill_peer import (
    FORMAT,
    PrefillPeer,
    block_digest,
    decode_worker,
    kv_caches,
)
from tests.support.waiting import wait_for

torch = pytest.importorskip("torch")

TOKEN = os.environ["KVCONNECT_TOKEN"]  # set by tests/conftest.py
CONFIG = VllmConnectorConfig.from_mapping(
    {"transport": "tcp", "read_timeout": 5.0, "rpc_timeout": 1.0}
)


@pytest.fixture
def decode() -> Iterator[tuple[ConnectorWorker, dict[str, Any]]]:
    with decode_worker(CONFIG) as pair:
        yield pair


def _read(worker: ConnectorWorker, job: RecvJob, timeout: float = 15.0) -> bool:
    """Run ``job`` on ``worker``; whether its KV arrived (False: recomputed or failed)."""
    worker.start(StepPlan(recv=(job,)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _sending, recving, failed = worker.results(set())
        if recving:
            assert recving == {job.request_id}
            return job.request_id not in failed
        time.sleep(0.01)
    raise AssertionError(f"{job.request_id}: no result (decode hangs)")


def _job(peer: PrefillPeer, rid: str, remote_blocks: tuple[int, ...], local: tuple[int, ...]):
    """A read of ``peer``'s request ``rid``, held there now."""
    peer.hold(rid)
    return RecvJob(f"d-{rid}", peer.remote(rid, remote_blocks), (local,), (remote_blocks,))


def _tcp_peers(worker: ConnectorWorker) -> int:
    return worker.engine.stats().transports["tcp"].peers


def test_a_prefill_replaced_at_its_endpoint_is_used_at_once(decode: Any) -> None:
    worker, caches = decode
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    with PrefillPeer(seed=1, port=port) as old:
        assert _read(worker, _job(old, "p1", (1, 2), (1, 2)))
        assert block_digest(caches, (1, 2)) == old.digest((1, 2))
        in_flight = _job(old, "p2", (3,), (3,))  # decode holds old's layout for it
        late = _job(old, "p3", (4,), (4,))  # read once decode learnt of the replacement
        old.kill()
    with PrefillPeer(seed=2, port=port) as new:
        assert new.engine_id != old.engine_id
        assert not _read(worker, in_flight), "old's blocks died with it: recompute"
        assert worker.load_errors() == {3}
        assert _read(worker, _job(new, "q1", (1, 2), (5, 6))), "the new prefill at once"
        assert block_digest(caches, (5, 6)) == new.digest((1, 2))
        assert worker.peers.engines() == {endpoint: new.engine_id}, "old's layout is gone"
        assert _tcp_peers(worker) == 1, "only the new prefill's connections are kept"
        asked = new.calls()["GetLayout"]
        assert not _read(worker, late)
        assert new.calls()["GetLayout"] == asked + 1, "decode asked who serves there now"
        assert worker.peers.engines() == {endpoint: new.engine_id}
        assert block_digest(caches, (4,)) == block_digest(kv_caches(seed=None), (4,))


def _footprint() -> tuple[int, int]:
    """Open fds and kvconnect threads."""
    return len(open_fds()), len(kvconnect_threads())


def _within(first: tuple[int, int]) -> bool:
    now = _footprint()
    return now[0] <= first[0] and now[1] <= first[1]


def test_repeated_replacements_leave_no_threads_sockets_or_connections(
    decode: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After each replacement (a read of the dead prefill's request, one of its successor's)
    and once the read lane's threads ended (idle), no more fds and threads than after the
    first: sockets of the dead, their connections and transfer state are gone."""
    monkeypatch.setattr(lanes, "_IDLE", 0.2)  # lane threads end (and release sockets) soon
    worker, caches = decode
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    stale: RecvJob | None = None  # a request of the prefill killed last
    first: tuple[int, int] | None = None
    for seed in range(1, 6):
        with PrefillPeer(seed=seed, port=port) as peer:
            if stale is not None:
                assert not _read(worker, stale)
            assert _read(worker, _job(peer, f"r{seed}", (seed,), (seed,)))
            assert block_digest(caches, (seed,)) == peer.digest((seed,))
            assert worker.peers.engines() == {endpoint: peer.engine_id}
            assert _tcp_peers(worker) == 1
            stale = _job(peer, f"s{seed}", (9,), (9,))
            peer.kill()
        wait_for(
            lambda: not any(t.name.startswith("kvconnect-vllm-read-") for t in kvconnect_threads()),
            "the read lane's threads end once idle",
        )
        if first is None:
            first = _footprint()
        else:  # zmq and the transport close asynchronously: wait for what is let go
            wait_for(
                functools.partial(_within, first),
                f"replacement {seed}: {_footprint()} (fds, threads); first {first}",
            )


def test_calls_to_a_dead_endpoint_never_reach_its_successor() -> None:
    """A DEALER socket queues what it sends while nothing listens and delivers it all once
    something does; a call that failed closes its socket, so a replacement gets no backlog."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    client = SideChannelClient(0.2, token=TOKEN)
    try:
        for rid in ("a", "b", "c"):
            with pytest.raises(PeerUnreachable):
                client.call(endpoint, msg.Renew([rid]))
        assert client.open_sockets() == 0
        with PrefillPeer(seed=1, port=port) as successor:
            assert client.call(endpoint, msg.Renew(["d"]), timeout=10) == msg.Ack(True)
            assert successor.renewals() == {"d": 1}
            assert client.open_sockets() == 1
    finally:
        client.close()


def test_a_late_reply_is_never_taken_for_the_next_calls() -> None:
    release = threading.Event()

    def handler(request: msg.Request) -> msg.Reply:
        assert isinstance(request, msg.GiveUp)
        if request.request_ids == ["slow"]:
            release.wait(10)  # answers after the caller timed out
        return msg.Ack(False, request.request_ids[0])

    server = SideChannelServer("127.0.0.1", 0, handler, token=TOKEN)
    client = SideChannelClient(0.3, token=TOKEN)
    server.start()
    endpoint = f"tcp://127.0.0.1:{server.port}"
    try:
        with pytest.raises(PeerUnreachable):
            client.call(endpoint, msg.GiveUp(["slow"]))
        release.set()
        for rid in ("next", "after"):
            assert client.call(endpoint, msg.GiveUp([rid]), timeout=10) == msg.Ack(False, rid)
    finally:
        client.close()
        server.close()


def _service(engine_id: str, segment: str, port: int = 0) -> PrefillService:
    service = PrefillService(engine_id, "127.0.0.1", port, lease=30, token=TOKEN)
    service.set_layouts({0: RankLayout(segment, "compat", (), FORMAT.kv_format())})
    service.start()
    return service


def test_the_layout_cache_is_bounded_and_evicts_the_least_recently_used() -> None:
    client = SideChannelClient(2.0, token=TOKEN)
    evicted: list[str] = []
    peers = PeerLayouts(client, capacity=2, on_evict=lambda reply: evicted.append(reply.engine_id))
    services = [_service(f"e{i}", f"seg{i}") for i in range(3)]
    ends = [f"tcp://127.0.0.1:{s.port}" for s in services]
    try:
        assert peers.get(ends[0], "e0").engine_id == "e0"
        assert peers.get(ends[1], "e1").engine_id == "e1"
        peers.get(ends[0], "e0")  # e0 used again: e1 is the least recently used
        peers.get(ends[2], "e2")
        assert evicted == ["e1"]
        assert peers.engines() == {ends[0]: "e0", ends[2]: "e2"}
        assert peers.segments() == {"seg0", "seg2"}
        with pytest.raises(PeerReplaced):  # a request planned for e9, which ends[0] is not
            peers.get(ends[0], "e9")
        assert peers.engines() == {ends[2]: "e2", ends[0]: "e0"}, "e0 still serves there"
        assert evicted == ["e1"]
    finally:
        for service in services:
            service.close()
        client.close()


def test_a_replacement_is_judged_afresh_after_its_predecessor_was_refused() -> None:
    client = SideChannelClient(2.0, token=TOKEN)
    evicted: list[str] = []
    peers = PeerLayouts(client, on_evict=lambda reply: evicted.append(reply.engine_id))
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        old = _service("old", "seg-old", port)
        try:
            peers.get(endpoint, "old")
            assert peers.refuse(endpoint, "old", "another dtype")
            assert not peers.refuse(endpoint, "old", "another dtype"), "logged once"
            with pytest.raises(IncompatiblePeer, match="another dtype"):
                peers.get(endpoint, "old")
        finally:
            old.close()
        new = _service("new", "seg-new", port)
        try:
            assert peers.get(endpoint, "new").ranks[0].segment == "seg-new"
            assert evicted == ["old"]
            assert peers.segments() == {"seg-new"}
        finally:
            new.close()
    finally:
        client.close()


class _View:
    """The parts of a vLLM request the scheduler side reads."""

    def __init__(self, request_id: str, params: dict[str, Any]) -> None:
        self.request_id = request_id
        self.kv_transfer_params = params
        self.num_prompt_tokens = 8
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []


def _params(peer: PrefillPeer, rid: str) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": peer.engine_id,
        "remote_request_id": rid,
        "remote_host": "127.0.0.1",
        "remote_port": peer.port,
        "remote_block_ids": [1],
    }


def test_a_dead_prefills_leases_stop_being_renewed_once_its_reads_failed() -> None:
    """Decode's scheduler renews the leases of requests waiting for their KV. Once the read
    of a killed prefill's request is reported (failed), it renews that lease no more: neither
    a later call nor one queued while the prefill was down reaches the prefill that replaced
    it, whose own requests are renewed."""
    client = SideChannelClient(0.5, token=TOKEN)
    keeper = LeaseKeeper(client, lease=0.6)  # a renewal round every 0.1 s
    scheduler = ConnectorScheduler(
        engine_id="decode", host="127.0.0.1", tp_size=1, block_size=4, keeper=keeper
    )
    port = free_port()
    keeper.start()
    try:
        with PrefillPeer(seed=1, port=port) as old:
            old.hold("p1")
            scheduler.on_new_request(_View("d1", _params(old, "p1")))
            wait_for(lambda: old.renewals().get("p1", 0) >= 2, "old's lease is renewed")
            old.kill()
        scheduler.on_transfers_done({"d1"})  # the read from old failed: reported
        with PrefillPeer(seed=2, port=port) as new:
            new.hold("q1")
            scheduler.on_new_request(_View("d2", _params(new, "q1")))
            wait_for(lambda: new.renewals().get("q1", 0) >= 5, "the new lease is renewed")
            assert "p1" not in new.renewals()
    finally:
        keeper.close()
        client.close()
