"""Store servers follow the master's journal; a new master indexes what they report.

Pure logic (MasterState and HeldObjects, explicit clock), with the servers' memory modelled:
every write stamps its range with the id of the put that made it, so a check can tell whether
an object's replicas hold that object's bytes or another put's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.store.config import MasterConfig
from kvconnect.store.held import HeldObjects
from kvconnect.store.master.objects import State
from kvconnect.store.master.state import MasterState
from kvconnect.store.messages import Change, Changes, Code, PutItem, SegmentSpec

pytestmark = pytest.mark.usefixtures("key_table")

KiB = 1 << 10
GRANULE = 64  # the master's default alignment: objects start and end on granules


def _config() -> MasterConfig:
    return MasterConfig(lease_ttl=10.0, put_timeout=5.0, quarantine=3.0, heartbeat_ttl=1e6)


@dataclass
class Server:
    """A store server as the master sees it: a journal follower and its memory."""

    name: str
    size: int
    host: str = "h1"
    held: HeldObjects = field(default_factory=HeldObjects)
    generation: int = 0
    memory: np.ndarray = field(init=False)  # put id stamped per granule

    def __post_init__(self) -> None:
        self.memory = np.zeros(self.size // GRANULE, dtype=np.int64)

    @property
    def mount_id(self) -> str:
        return f"{self.name}-mount-{self.generation}"

    @property
    def engine(self) -> str:
        return f"engine-{self.name}"

    def spec(self) -> SegmentSpec:
        # The region id changes with every mount: the fence of a real server.
        return SegmentSpec(self.name, self.engine, self.generation + 1, self.size, self.host)

    def mount(self, state: MasterState, now: float, chunk: int = 1000) -> None:
        report = self.held.report()
        chunks = [report[i : i + chunk] for i in range(0, len(report), chunk)] or [[]]
        code = state.mount(self.name, self.mount_id, self.spec(), now, chunks[0], len(chunks) > 1)
        assert code is Code.OK
        for n, held in enumerate(chunks[1:], start=2):
            assert state.report(self.name, self.mount_id, held, n < len(chunks), now) is Code.OK

    def remount(self, state: MasterState, now: float, chunk: int = 1000) -> None:
        self.generation += 1
        self.held.new_mount()
        self.mount(state, now, chunk)

    def heartbeat(self, state: MasterState, now: float, lose_reply: bool = False) -> bool:
        """One heartbeat; applies the reply unless it is lost. Whether changes came."""
        unknown, changes = state.heartbeat(self.name, [self.mount_id], [self.held.applied], now)
        assert unknown == []
        if lose_reply:
            return False
        self.held.apply(changes[0])
        return bool(changes[0].changes)

    def sync(self, state: MasterState, now: float) -> None:
        while self.heartbeat(state, now):
            pass

    def write(self, offset: int, size: int, stamp: int) -> None:
        self.memory[offset // GRANULE : -(-(offset + size) // GRANULE)] = stamp

    def holds(self, offset: int, size: int, stamp: int) -> bool:
        return bool(
            (self.memory[offset // GRANULE : -(-(offset + size) // GRANULE)] == stamp).all()
        )


class Cluster:
    """A master, servers and the bytes each committed copy should hold."""

    def __init__(self, servers: list[Server]) -> None:
        self.servers = {s.engine: s for s in servers}
        self.state = MasterState(_config(), seed=1)
        self.stamps = itertools.count(1)
        # (key, engine segment, offset) → stamp of the put that committed that copy
        self.expected: dict[tuple[str, str, int], int] = {}
        self.pending: dict[str, tuple[int, int]] = {}  # key → (put id, stamp), written not ended
        for server in servers:
            server.mount(self.state, 0.0)

    def start(self, key: str, size: int, now: float, replicas: int = 1) -> Code:
        """put_start and write the bytes (not ended yet)."""
        placement = self.state.put_start("c", [PutItem(key, size)], replicas, "h1", False, now)[0]
        if placement.code is Code.OK:
            stamp = next(self.stamps)
            for location in placement.locations:
                self.servers[location.segment].write(location.offset, size, stamp)
            self.pending[key] = (placement.put, stamp)
        return placement.code

    def end(self, key: str, now: float) -> Code:
        put, stamp = self.pending.pop(key)
        code = self.state.put_end([key], [0], [put], now)[0]
        if code is Code.OK:
            for location in self.state.get_replicas([key], now)[0].locations:
                self.expected[(key, location.segment, location.offset)] = stamp
        return code

    def put(self, key: str, size: int, now: float, replicas: int = 1) -> Code:
        code = self.start(key, size, now, replicas)
        return self.end(key, now) if code is Code.OK else code

    def failover(self, now: float, chunk: int = 1000) -> None:
        """A new master; every server fences and reports what it holds."""
        self.state = MasterState(_config(), seed=2)
        for server in self.servers.values():
            server.remount(self.state, now, chunk)
        # The fence makes the old master's writers fail: their puts never end.
        self.pending.clear()

    def check_bytes(self) -> None:
        """Every complete object's replicas hold the bytes its own put wrote."""
        objects = self.state.objects
        for key, slot in objects.items():
            if objects.state[slot] != State.COMPLETE:
                continue
            for index, offset in objects.replicas(slot):
                segment = self.state.segments.all[index]
                if not segment.alive:
                    continue
                engine = segment.spec.engine_segment
                stamp = self.expected.get((key, engine, offset))
                assert stamp is not None, f"{key} at {engine}:{offset} was never committed there"
                assert self.servers[engine].holds(offset, objects.size[slot], stamp), (
                    f"{key} at {engine}:{offset} holds another put's bytes"
                )


def test_servers_follow_the_journal_and_released_space_waits_for_the_acknowledgement() -> None:
    server = Server("a", 4 * KiB)
    cluster = Cluster([server])
    state = cluster.state
    assert cluster.put("k1", 2 * KiB, 0.0) is Code.OK
    assert cluster.put("k2", 2 * KiB, 0.0) is Code.OK
    server.sync(state, 0.0)
    assert len(server.held) == 2
    assert server.held.get("k1") == (state.get_replicas(["k1"], 0.0)[0].locations[0].offset, 2048)
    assert state.remove(["k1"], True, 20.0) == [Code.OK]
    # BUSY, not NO_SPACE: the space is on its way back
    assert cluster.put("k3", 2 * KiB, 20.0) is Code.BUSY, "k1's space is not reusable yet"
    assert server.heartbeat(state, 20.0, lose_reply=True) is False
    assert cluster.put("k3", 2 * KiB, 20.0) is Code.BUSY, "the server never heard of it"
    assert server.heartbeat(state, 20.0), "the lost changes come again"
    assert server.held.get("k1") is None
    assert cluster.put("k3", 2 * KiB, 20.0) is Code.BUSY, "applied, not acknowledged yet"
    server.heartbeat(state, 20.0)
    assert cluster.put("k3", 2 * KiB, 20.0) is Code.OK
    server.sync(state, 20.0)
    assert sorted(change.key for change in server.held.report()) == ["k2", "k3"]
    cluster.check_bytes()


def test_a_repeated_journal_reply_is_applied_once() -> None:
    held = HeldObjects()
    first = Changes("m", 0, [Change("a", 0, 64), Change("b", 64, 64)])
    held.apply(first)
    held.apply(first)
    held.apply(Changes("m", 1, [Change("b", 64, 64), Change("", 0, 64), Change("c", 0, 64)]))
    assert held.applied == 4
    assert held.report() == [Change("c", 0, 64), Change("b", 64, 64)]
    held.apply(Changes("m", 9, [Change("x", 128, 64)]))  # a gap: refused, nothing changes
    assert held.applied == 4
    assert held.get("x") is None


def test_a_new_master_indexes_what_the_servers_report() -> None:
    a, b = Server("a", 64 * KiB), Server("b", 64 * KiB, host="h2")
    cluster = Cluster([a, b])
    for i in range(12):
        assert cluster.put(f"k{i}", (i % 3 + 1) * KiB, 0.0, replicas=2 if i < 4 else 1) is Code.OK
    assert cluster.start("unfinished", KiB, 0.0) is Code.OK
    a.sync(cluster.state, 0.0)
    b.sync(cluster.state, 0.0)
    assert cluster.put("unreported", KiB, 0.0) is Code.OK  # committed, journal not delivered
    keys = [f"k{i}" for i in range(12)]
    before = {
        k: sorted((loc.segment, loc.offset) for loc in r.locations)
        for k, r in zip(keys, cluster.state.get_replicas(keys, 0.0), strict=True)
    }
    cluster.failover(1.0, chunk=5)
    state = cluster.state
    assert state.objects.index.get("unreported") < 0, "lost: its commit never reached a server"
    assert state.objects.index.get("unfinished") < 0
    assert state.exists(keys) == [True] * 12
    after = {
        k: sorted((loc.segment, loc.offset) for loc in r.locations)
        for k, r in zip(keys, state.get_replicas(keys, 1.0), strict=True)
    }
    assert after == {k: before[k] for k in keys}, "same replicas, offsets and segments"
    assert state.get_replicas(["k0"], 1.0)[0].locations[0].region == 2, "the fenced region"
    assert state.bytes_stored == sum((i % 3 + 1) * KiB for i in range(12))
    # new puts fill the gaps, never the recovered objects' space
    for i in range(40):
        cluster.put(f"new{i}", KiB, 2.0)
    cluster.check_bytes()


def test_nothing_is_allocated_in_a_segment_until_its_report_is_complete() -> None:
    a = Server("a", 16 * KiB)
    cluster = Cluster([a])
    for i in range(4):
        assert cluster.put(f"k{i}", KiB, 0.0) is Code.OK
    a.sync(cluster.state, 0.0)
    state = MasterState(_config())
    a.generation += 1
    a.held.new_mount()
    report = a.held.report()
    assert state.mount("a", a.mount_id, a.spec(), 0.0, report[:2], more=True) is Code.OK
    assert state.exists(["k0", "k1", "k2"]) == [True, True, False]
    placement = state.put_start("c", [PutItem("new", KiB)], 1, "h1", False, 0.0)[0]
    assert placement.code is Code.NO_SPACE, "the segment is still being reported"
    assert state.report("a", a.mount_id, report[2:], False, 0.0) is Code.OK
    assert state.report("a", a.mount_id, report[2:], False, 0.0) is Code.OK, "a repeat is OK"
    assert state.exists(["k2", "k3"]) == [True, True]
    assert state.put_start("c", [PutItem("new", KiB)], 1, "h1", False, 0.0)[0].code is Code.OK
    assert state.report("x", "unknown-mount", [], False, 0.0) is Code.UNKNOWN_SEGMENT


def test_reports_the_new_master_cannot_use_are_released() -> None:
    a, b = Server("a", 16 * KiB), Server("b", 16 * KiB)
    state = MasterState(_config())
    a.held.apply(Changes("m", 0, [Change("same", 0, KiB), Change("odd", 1024, 100)]))
    b.held.apply(Changes("m", 0, [Change("same", 0, 2 * KiB), Change("late", 4096, KiB)]))
    a.held.apply(Changes("m", 2, [Change("bad", 1000, 64)]))  # misaligned: a is told to drop it
    a.remount(state, 0.0)
    placement = state.put_start("c", [PutItem("late", KiB)], 1, "h1", False, 0.0)[0]
    assert placement.code is Code.OK  # "late" is being written again at the new master
    b.remount(state, 0.0)
    # b claims more than the master sent: the master must not drop what b has not seen
    state.heartbeat("b", [b.mount_id], [5], 0.0)
    replicas = state.get_replicas(["same", "odd", "late"], 0.0)
    assert [r.code for r in replicas] == [Code.OK, Code.OK, Code.NOT_FOUND]
    assert [loc.segment for loc in replicas[0].locations] == ["engine-a"], "b's has another size"
    b.sync(state, 0.0)
    assert b.held.report() == [], "b was told to drop both copies"
    a.sync(state, 0.0)
    assert [c.key for c in a.held.report()] == ["same", "odd"]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            # puts, removals, syncs and failovers interleaved are where bytes could go wrong
            st.sampled_from(
                [
                    *("put", "put", "start", "end", "get", "remove", "remove", "tick"),
                    *("sync", "sync", "lose", "failover", "failover"),
                ]
            ),
            st.integers(0, 9),
            st.integers(1, 8),
        ),
        max_size=60,
    )
)
def test_no_object_is_ever_indexed_over_another_puts_bytes(ops: list[tuple[str, int, int]]) -> None:
    servers = [Server("a", 16 * KiB), Server("b", 16 * KiB, host="h2")]
    cluster = Cluster(servers)
    now = 0.0
    for op, n, kib in ops:
        now += 0.5
        key = f"k{n}"
        server = servers[n % 2]
        state = cluster.state
        if op == "put":
            cluster.put(key, kib * KiB, now, replicas=1 + n % 2)
        elif op == "start":
            cluster.start(key, kib * KiB, now)
        elif op == "end" and key in cluster.pending:
            cluster.end(key, now)
        elif op == "get":
            state.get_replicas([key], now)
        elif op == "remove":
            state.remove([key], n % 3 == 0, now)
        elif op == "tick":
            state.tick(now)
        elif op in ("sync", "lose"):
            server.heartbeat(state, now, lose_reply=op == "lose")
        elif op == "failover":
            cluster.failover(now, chunk=kib)
        cluster.check_bytes()


def test_a_key_removed_under_a_lease_is_forgotten_by_its_server_at_once() -> None:
    server = Server("a", 4 * KiB)
    cluster = Cluster([server])
    state = cluster.state
    assert cluster.put("k1", 2 * KiB, 0.0) is Code.OK
    server.sync(state, 0.0)
    assert state.get_replicas(["k1"], 1.0)[0].code is Code.OK  # leased until 11
    assert state.remove(["k1"], True, 1.0) == [Code.OK]
    server.sync(state, 1.5)  # one heartbeat brings the release, the next acknowledges it
    assert server.held.get("k1") is None, "the release waited for the lease"
    # the reader may still read k1's bytes: its space stays unused until the lease ends
    assert cluster.put("k2", 2 * KiB, 2.0) is Code.OK
    assert cluster.put("k3", 2 * KiB, 2.0) is Code.BUSY
    state.tick(11.0)
    assert cluster.put("k3", 2 * KiB, 11.0) is Code.OK
    cluster.check_bytes()
    # a new master (restart, failover) never indexes k1 again
    server.sync(cluster.state, 11.0)
    state.remove(["k2"], True, 11.0)
    assert state.get_replicas(["k3"], 11.5)[0].code is Code.OK
    assert state.remove(["k3"], True, 11.5) == [Code.OK]
    server.heartbeat(cluster.state, 11.5)  # k3's release reaches the server; k2's too
    cluster.failover(12.0)
    assert cluster.state.exists(["k1", "k2", "k3"]) == [False, False, False]
