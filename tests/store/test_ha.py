"""Master high availability with a real etcd: three masters, store servers, a live workload."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from datetime import datetime

import numpy as np
import pytest

from kvconnect.bench.etcd import EtcdServer, etcd_available
from kvconnect.bench.failover import busy_processes
from kvconnect.errors import StoreError
from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Process, free_port
from kvconnect.store.messages import Code
from kvconnect.testing.peer import pattern
from tests.support.ha import leader_of, leader_stats
from tests.support.netns import ip, namespace
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not etcd_available(), reason="etcd is not installed"),
]
MiB = 1 << 20
# Big enough that the workload never evicts: every page it stored must survive a failover.
SERVER = ["--store-size", "256M", "--store-heartbeat-interval", "0.3"]


def _master(url: str, host: str = "127.0.0.1", netns: str | None = None) -> Process:
    args = ["master", "--ha", url, "--master-listen", f"tcp://{host}:{free_port()}"]
    return Process(args, "listening on", netns=netns)


class _Workload:
    """A client putting and reading back pages in a loop; every OK read is checked."""

    def __init__(self, url: str) -> None:
        config = StoreClientConfig(
            master=url, rpc_timeout=0.5, io_timeout=1.0, breaker_cooldown=0.1
        )
        self.client = StoreClient(config)
        self.client.start()
        self.buffer = self.client.register(np.zeros(2 * MiB, dtype=np.uint8))
        self.ok: list[float] = []  # when each successful put + read-back started
        self.failed: list[float] = []
        self.stored: list[tuple[float, int]] = []  # (when, n) of each page put and read back
        self.corrupt = 0
        self.slowest = 0.0
        self._stop = threading.Event()
        self.held = threading.Event()  # set: the loop stops between two operations
        self.idle = threading.Event()  # set by the loop once held: no operation under way
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> _Workload:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pause()
        self.client.close()

    def pause(self) -> None:
        """Stop the loop (the client stays open)."""
        self._stop.set()
        self._thread.join(timeout=30)

    def read(self, n: int) -> Code:
        """Read page ``n`` back; a wrong byte counts as corrupt."""
        codes = self.client.batch_get_into([f"page-{n}"], self.buffer, [MiB], [MiB]).codes
        if codes[0] is Code.OK and self.buffer.view[MiB:] != pattern(n, MiB).data:
            self.corrupt += 1
        return codes[0]

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            if self.held.is_set():
                self.idle.set()
                time.sleep(0.01)
                continue
            self.idle.clear()
            n += 1
            key = f"page-{n}"
            self.buffer.view[:MiB] = pattern(n, MiB).data
            start = time.monotonic()
            try:
                put = self.client.batch_put_from([key], self.buffer, [0], [MiB]).codes[0]
                got = self.client.batch_get_into([key], self.buffer, [MiB], [MiB]).codes[0]
            except StoreError:
                put = got = Code.UNAVAILABLE
            self.slowest = max(self.slowest, time.monotonic() - start)
            if got is Code.OK and self.buffer.view[MiB:] != pattern(n, MiB).data:
                self.corrupt += 1
            now = time.monotonic()
            if put is Code.OK and got is Code.OK:
                self.ok.append(start)  # an op that began before a kill is not "resumed"
                self.stored.append((now, n))
            else:
                self.failed.append(now)
            time.sleep(0.05)


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


def _mounted(url: str) -> int:
    """Segments the leader has mounted (0 while none answers)."""
    reply = leader_stats(url)
    return 0 if reply is None else len(reply.segments)


def _backlog(url: str) -> int:
    """Journal changes the leader's store servers have not acknowledged (-1: no answer)."""
    reply = leader_stats(url)
    return -1 if reply is None else sum(s.backlog for s in reply.segments)


def test_sigkill_of_the_leader_fails_over_within_three_seconds(etcd: EtcdServer) -> None:
    masters = [_master(etcd.url) for _ in range(3)]
    servers = [
        Process(["store", "--store-master", etcd.url, *SERVER], "store server") for _ in range(2)
    ]
    try:
        with _Workload(etcd.url) as work:
            wait_for(lambda: len(work.ok) > 5, "the workload never succeeded", 15)
            # Pages stored before a moment the leader's journal was fully acknowledged are
            # known to their store server: the new leader must index every one of them. The
            # workload holds still for that moment (a put every few tens of ms can keep the
            # journal from ever being acknowledged whole on a loaded machine), then goes on.
            work.held.set()
            wait_for(work.idle.is_set, "the workload did not hold still", 15)
            wait_for(lambda: _backlog(etcd.url) == 0, "the servers never caught up", 15)
            durable = [n for _when, n in work.stored]
            work.held.clear()
            wait_for(lambda: work.stored[-1][1] > durable[-1], "the workload did not go on", 15)
            leader = leader_of(etcd.url)
            victim = next(m for m in masters if leader is not None and leader in m.args)
            victim.kill()
            killed = time.monotonic()
            wait_for(lambda: leader_of(etcd.url) not in (None, leader), "no new leader", 10)
            elected = time.monotonic() - killed
            wait_for(
                lambda: bool(work.ok) and work.ok[-1] > killed, "the workload did not resume", 15
            )
            resumed = min(t for t in work.ok if t > killed) - killed
            work.pause()
            # each store server reports its pages when its own heartbeat finds the new leader
            wait_for(lambda: _mounted(etcd.url) == 2, "a store server did not mount again", 10)
            survived = [work.read(n) for n in durable]
        assert survived == [Code.OK] * len(durable), "pages stored before the failover were lost"
        assert elected < 3.0, f"a standby took {elected:.2f}s to lead"
        assert resumed < 5.0, f"the workload resumed after {resumed:.2f}s"
        assert work.corrupt == 0
        assert any(killed < t < killed + resumed for t in work.failed), "the gap failed cleanly"
        assert work.slowest < 5.0, "an operation hung"
    finally:
        for process in (*servers, *masters):
            process.stop()


def test_etcd_restart_during_the_workload_hangs_nothing(etcd: EtcdServer) -> None:
    masters = [_master(etcd.url) for _ in range(2)]
    servers = [Process(["store", "--store-master", etcd.url, *SERVER], "store server")]
    try:
        with _Workload(etcd.url) as work:
            wait_for(lambda: len(work.ok) > 5, "the workload never succeeded", 15)
            etcd.kill()
            killed = time.monotonic()
            # the outage is felt: the leader cannot renew its lease and stops serving
            wait_for(lambda: any(t > killed for t in work.failed), "nothing failed", 15)
            etcd.start()
            restarted = time.monotonic()
            wait_for(lambda: bool(work.ok) and work.ok[-1] > restarted, "no recovery", 20)
            wait_for(lambda: leader_of(etcd.url) is not None, "no leader after the restart", 10)
        assert work.corrupt == 0
        assert work.slowest < 5.0, "an operation hung"
    finally:
        for process in (*servers, *masters):
            process.stop()


_LOG = re.compile(r"^(\S+ \S+) .*master (\S+) (is the leader|steps down) \(term (\d+)\)")


def _events(process: Process) -> list[tuple[datetime, str, int]]:
    events = []
    for line in process.stderr().splitlines():
        match = _LOG.match(line)
        if match:
            when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            events.append((when, match.group(3), int(match.group(4))))
    return events


@pytest.mark.netns
def test_partitioned_leader_steps_down_before_another_is_elected() -> None:
    with namespace("ha", "10.203.0") as ns, EtcdServer(extra_hosts=(ns.outside,)) as etcd:
        isolated = _master(f"etcd://{ns.outside}:{etcd.client_port}", ns.inside, netns=ns.name)
        wait_for(lambda: leader_of(etcd.url) is not None, "the first master did not lead", 10)
        others = [_master(etcd.url) for _ in range(2)]
        try:
            old_term = _events(isolated)[-1][2]
            ip(f"link set {ns.outside_dev} down")  # the partition
            wait_for(lambda: leader_of(etcd.url) not in (None, *isolated.args), "no failover", 15)
            wait_for(
                lambda: any(e[1] == "steps down" for e in _events(isolated)), "no step-down", 10
            )
            stepped = next(e for e in _events(isolated) if e[1] == "steps down")

            def elected() -> list[tuple[datetime, str, int]]:
                return [e for p in others for e in _events(p) if e[1] == "is the leader"]

            # etcd may name the new leader a moment before its log line is written
            wait_for(lambda: bool(elected()), "the new leader logged nothing", 5)
            elected_events = elected()
            assert min(e[0] for e in elected_events) > stepped[0], "two leaders at once"
            assert all(e[2] > old_term for e in elected_events), "the new term is later"
            ip(f"link set {ns.outside_dev} up")  # healed: the old leader stays a standby
            time.sleep(2.0)
            assert not any(e[1] == "is the leader" and e[0] > stepped[0] for e in _events(isolated))
        finally:
            for process in (*others, isolated):
                process.stop()


HEARTBEAT = 0.2  # the store server's heartbeat interval in the next test


def test_objects_older_than_two_heartbeats_survive_a_failover_under_load(etcd: EtcdServer) -> None:
    masters = [_master(etcd.url) for _ in range(2)]
    args = ["--store-size", "64M", "--store-heartbeat-interval", str(HEARTBEAT)]
    server = Process(["store", "--store-master", etcd.url, *args], "store server")
    config = StoreClientConfig(master=etcd.url, rpc_timeout=1.0, breaker_cooldown=0.1)
    client = StoreClient(config)
    client.start()
    try:
        wait_for(lambda: _mounted(etcd.url) == 1, "the store server did not mount", 15)
        values = {f"durable-{n}": pattern(n, 4096).tobytes() for n in range(300)}
        with busy_processes(2):  # every core of the machine is busy
            for key, value in values.items():
                assert client.put(key, value) is Code.OK, key
            time.sleep(2.5 * HEARTBEAT)  # the scenario: every put ended > 2 heartbeats ago
            leader = leader_of(etcd.url)
            victim = next(m for m in masters if leader is not None and leader in m.args)
            victim.kill()
            wait_for(lambda: leader_of(etcd.url) not in (None, leader), "no new leader", 15)
            wait_for(lambda: _mounted(etcd.url) == 1, "the store server did not mount again", 15)
            # The new leader indexed every object the server reported. The client still
            # names the dead leader: its first call must find the new one within its timeout.
            known = client.batch_exists(list(values))
            lost = [key for key, there in zip(values, known, strict=True) if not there]
            assert lost == [], f"{len(lost)} of {len(values)} objects lost"
            buffer = client.register(np.zeros(len(values) * 4096, dtype=np.uint8))
            offsets = [n * 4096 for n in range(len(values))]
            result = client.batch_get_into(list(values), buffer, offsets, [4096] * len(values))
        assert result.codes == (Code.OK,) * len(values)
        assert bytes(buffer.view) == b"".join(values.values()), "other bytes came back"
    finally:
        client.close()
        for process in (server, *masters):
            process.stop()
