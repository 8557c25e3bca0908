"""Random operations on a master with DRAM and disk tiers, against a model of the servers'
memory: every write stamps its range with the id of the put that made it, and a server copies
a move's source bytes when it applies the move (as the disk tier stages them; it may put a
move off to a later heartbeat, as the disk tier does while an I/O is in flight), so a check can
tell whether each replica — and each read still under its lease — holds its own object's
bytes, also after a new master indexed what the servers report they hold. Pure logic,
explicit clock."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.store.config import MasterConfig
from kvconnect.store.master.objects import Replica, State
from kvconnect.store.master.state import MasterState
from kvconnect.store.messages import Change, Code, Moved, PutItem, SegmentSpec, Tier, TierReport

pytestmark = pytest.mark.usefixtures("key_table")

KiB = 1 << 10
GRANULE = 64


@dataclass
class Mount:
    """One segment of a server: its memory (a put id per granule) and journal position."""

    tier: Tier
    size: int
    generation: int = 0
    applied: int = 0
    held: dict[int, tuple[str, int]] = field(default_factory=dict)  # offset → key, size
    memory: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.memory = np.zeros(self.size // GRANULE, dtype=np.int64)

    def span(self, offset: int, size: int) -> slice:
        return slice(offset // GRANULE, -(-(offset + size) // GRANULE))


@dataclass
class Server:
    """A store server with one DRAM and one disk segment, following both journals."""

    name: str
    host: str
    mounts: dict[Tier, Mount]
    # moves applied, not reported: (target tier, offset) → key, the copied source bytes (None:
    # the source is gone, the move can only fail)
    staged: dict[tuple[Tier, int], tuple[str, int, np.ndarray | None, int]] = field(
        default_factory=dict
    )
    # (key, server, tier, offset) → stamp of the put whose bytes a committed copy should hold
    expected: dict[tuple[str, str, Tier, int], int] = field(default_factory=dict)

    def mount_id(self, tier: Tier) -> str:
        return f"{self.name}-{tier.name}-{self.mounts[tier].generation}"

    def region(self, tier: Tier) -> int:
        return 1 + int(tier) + 2 * self.mounts[tier].generation  # a new mount fences

    def spec(self, tier: Tier) -> SegmentSpec:
        name = self.name if tier is Tier.DRAM else f"{self.name}/disk0"
        size = self.mounts[tier].size
        return SegmentSpec(name, f"engine-{self.name}", self.region(tier), size, self.host, tier)

    def mount(self, state: MasterState, tier: Tier, now: float) -> None:
        mount = self.mounts[tier]
        mount.applied = 0
        held = [Change(key, offset, size) for offset, (key, size) in sorted(mount.held.items())]
        code = state.mount(self.name, self.mount_id(tier), self.spec(tier), now, held)
        assert code is Code.OK

    def sync(self, state: MasterState, now: float, order: int) -> None:
        """One heartbeat: apply the journals' new changes (in either order; ``order`` 2: the
        disk's are put off to a later beat), acknowledge."""
        tiers = [Tier.DISK, Tier.DRAM] if order == 1 else [Tier.DRAM, Tier.DISK]
        ids = [self.mount_id(t) for t in tiers]
        applied = [self.mounts[t].applied for t in tiers]
        unknown, journals = state.heartbeat(self.name, ids, applied, now)
        assert unknown == []
        for tier, changes in zip(tiers, journals, strict=True):
            if tier is Tier.DISK and order == 2:
                continue
            mount = self.mounts[tier]
            for change in changes.changes[mount.applied - changes.first :]:
                if change.source_region:
                    self._stage(tier, change)
                elif change.key:
                    mount.held[change.offset] = (change.key, change.size)
                else:
                    mount.held.pop(change.offset, None)
            mount.applied = changes.first + len(changes.changes)
        state.heartbeat(self.name, ids, [self.mounts[t].applied for t in tiers], now)

    def _stage(self, tier: Tier, change: Change) -> None:
        # The source is this server's other segment; its bytes are copied now.
        source = self.mounts[Tier.DRAM if tier is Tier.DISK else Tier.DISK]
        stamps = None
        if change.source_region == self.region(source.tier):  # else: a disk lost since
            stamps = source.memory[source.span(change.source_offset, change.size)].copy()
        where = (change.key, self.name, source.tier, change.source_offset)
        stamp = self.expected.get(where, -1)  # -1: the master moved what it never committed
        self.staged[(tier, change.offset)] = (change.key, change.size, stamps, stamp)

    def finish(self, state: MasterState, now: float, n: int, ok: bool) -> None:
        """Report the ``n``-th staged move done (its bytes written at the target) or failed."""
        if not self.staged:
            return
        (tier, offset), staged = sorted(self.staged.items())[n % len(self.staged)]
        key, size, stamps, stamp = staged
        del self.staged[(tier, offset)]
        mount = self.mounts[tier]
        moved = [Moved(key, offset)]
        ok = ok and stamps is not None
        if stamps is not None and ok:
            mount.memory[mount.span(offset, size)] = stamps
            self.expected[(key, self.name, tier, offset)] = stamp
            if tier is Tier.DISK:  # indexed on disk: held (in DRAM only once committed)
                mount.held[offset] = (key, size)
        report = TierReport(
            self.mount_id(tier), done=moved if ok else [], failed=[] if ok else moved
        )
        state.heartbeat(self.name, [], [], now, [report])

    def lose_disk(self, state: MasterState, now: float) -> None:
        """The disk tier goes down and comes back empty (a new mount)."""
        assert state.unmount(self.name, [self.mount_id(Tier.DISK)]) == [Code.OK]
        self.staged = {k: v for k, v in self.staged.items() if k[0] is not Tier.DISK}
        disk = self.mounts[Tier.DISK]
        disk.generation += 1
        disk.memory[:] = 0
        disk.held.clear()
        self.mount(state, Tier.DISK, now)

    def remount(self, state: MasterState, now: float) -> None:
        """Mount both segments at a new master, reporting what they hold (moves under way
        are given up: the old master's outcomes mean nothing to the new one)."""
        self.staged.clear()
        for tier in Tier:
            self.mounts[tier].generation += 1
            self.mount(state, tier, now)


class Cluster:
    def __init__(self) -> None:
        self.config = MasterConfig(
            lease_ttl=10.0,
            put_timeout=5.0,
            quarantine=3.0,
            heartbeat_ttl=1e6,
            high_watermark=0.7,
            evict_fraction=0.3,
            demotion_inflight=48 * KiB,
            promote_window=20.0,
        )
        self.state = MasterState(self.config, seed=1)
        self.servers = [
            Server(
                name,
                host,
                {Tier.DRAM: Mount(Tier.DRAM, 16 * KiB), Tier.DISK: Mount(Tier.DISK, 20 * KiB)},
            )
            for name, host in (("a", "h1"), ("b", "h2"))
        ]
        for server in self.servers:
            server.mount(self.state, Tier.DRAM, 0.0)
            server.mount(self.state, Tier.DISK, 0.0)
        self.stamps = itertools.count(1)
        self.expected: dict[tuple[str, str, Tier, int], int] = {}
        for server in self.servers:
            server.expected = self.expected
        self.reads: list[tuple[str, int, int, int, int, float]] = []  # engine, region, ...

    def failover(self, now: float) -> None:
        """A new master indexes what the servers report (reads of the old one are over)."""
        self.state = MasterState(self.config, seed=2)
        for server in self.servers:
            server.remount(self.state, now)
        self.reads.clear()

    def _where(self, engine: str, region: int) -> tuple[Server, Tier]:
        server = next(s for s in self.servers if f"engine-{s.name}" == engine)
        return server, next(t for t in Tier if server.region(t) == region)

    def _mount_at(self, engine: str, region: int) -> Mount:
        server, tier = self._where(engine, region)
        return server.mounts[tier]

    def _expected(self, key: str, engine: str, region: int, offset: int) -> int:
        server, tier = self._where(engine, region)
        stamp = self.expected.get((key, server.name, tier, offset))
        assert stamp is not None, f"{key} at {engine}:{region}:{offset} was never committed there"
        return stamp

    def put(self, key: str, size: int, now: float, replicas: int) -> None:
        state = self.state
        placement = state.put_start("c", [PutItem(key, size)], replicas, "h1", False, now)[0]
        if placement.code is not Code.OK:
            return
        stamp = next(self.stamps)
        for location in placement.locations:
            mount = self._mount_at(location.segment, location.region)
            assert mount.tier is Tier.DRAM, "a put went to disk"
            mount.memory[mount.span(location.offset, size)] = stamp
        if state.put_end([key], [0], [placement.put], now) == [Code.OK]:
            for loc in placement.locations:
                server, tier = self._where(loc.segment, loc.region)
                self.expected[(key, server.name, tier, loc.offset)] = stamp

    def get(self, key: str, now: float) -> None:
        replicas = self.state.get_replicas([key], now)[0]
        if replicas.code is not Code.OK:
            return
        tiers = [self._mount_at(loc.segment, loc.region).tier for loc in replicas.locations]
        assert tiers == sorted(tiers), "DRAM replicas come first"
        for loc in replicas.locations:
            stamp = self._expected(key, loc.segment, loc.region, loc.offset)
            self.reads.append((loc.segment, loc.region, loc.offset, replicas.size, stamp, now + 10))

    def check(self, now: float) -> None:
        state = self.state
        objects = state.objects
        # every live replica of a complete object holds its own put's bytes
        for key, slot in objects.items():
            if objects.state[slot] != State.COMPLETE:
                continue
            for index, offset in objects.replicas(slot):
                segment = state.segments.all[index]
                if not segment.alive:
                    continue
                engine, region = segment.spec.engine_segment, segment.spec.region
                mount = self._mount_at(engine, region)
                span = mount.memory[mount.span(offset, objects.size[slot])]
                stamp = self._expected(key, engine, region, offset)
                assert (span == stamp).all(), f"{key} at {segment.spec.name}:{offset}"
        # a read under its lease still finds the bytes it was given
        self.reads = [r for r in self.reads if r[5] > now]
        for engine, region, offset, size, stamp, _until in self.reads:
            if not any(
                s.alive and s.spec.region == region and s.spec.engine_segment == engine
                for s in state.segments.all
            ):
                continue  # its segment went away: the read fails, it reads nothing wrong
            mount = self._mount_at(engine, region)
            assert (mount.memory[mount.span(offset, size)] == stamp).all(), "leased bytes changed"
        _check_books(state)


def _check_books(state: MasterState) -> None:
    """bytes_stored is the complete objects' sizes; no two things share a segment's space;
    each segment's usage is its replicas and move targets, less demotions' held sources."""
    objects = state.objects
    spans: dict[int, list[tuple[int, int]]] = {}
    used: dict[int, int] = {}
    stored = 0

    def take(replica: Replica, size: int, sign: int = 1) -> None:
        segment = state.segments.all[replica.segment]
        length = segment.allocator.length(size)
        used[replica.segment] = used.get(replica.segment, 0) + sign * length
        if sign > 0:
            spans.setdefault(replica.segment, []).append((replica.offset, replica.offset + length))

    for _key, slot in objects.items():
        size = objects.size[slot]
        if objects.state[slot] == State.COMPLETE:
            stored += size
        for replica in objects.replicas(slot):
            take(replica, size)
    for slot, move in objects.moving.items():
        assert (move.slot, move.key, move.cancelled) == (slot, objects.index.key(slot), False)
        assert objects.moves[move.target] is move
        assert objects.state[slot] == State.COMPLETE
    for move in objects.moves.values():
        take(move.target, move.size)
        if move.holds_source and not move.cancelled:
            take(move.source, move.size, -1)
    assert stored == state.bytes_stored
    for index, taken in spans.items():
        taken.sort()
        for (_a, end), (start, _b) in itertools.pairwise(taken):
            assert end <= start, f"overlap in segment {index}"
    for segment in state.segments.live():
        assert segment.used == used.get(segment.index, 0), segment.spec.name
        assert 0 <= segment.in_transit <= segment.allocator.used


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                [
                    *("put", "put", "put", "get", "get", "remove", "tick", "tick"),
                    *("sync", "sync", "sync", "done", "done", "done", "fail", "lost"),
                    *("lose_disk", "failover"),
                ]
            ),
            st.integers(0, 11),
            st.integers(1, 6),
        ),
        min_size=40,
        max_size=100,
    )
)
def test_tiers_never_serve_another_objects_bytes(ops: list[tuple[str, int, int]]) -> None:
    cluster = Cluster()
    now = 0.0
    for op, n, kib in ops:
        state = cluster.state
        now += 0.25
        key = f"k{n}"
        server = cluster.servers[n % 2]
        if op == "put":
            cluster.put(key, kib * KiB, now, replicas=1 + (n % 3 == 0))
        elif op == "get":
            for _ in range(1 + kib % 2):  # read again at once: a promotion's second hit
                cluster.get(key, now)
        elif op == "remove":
            state.remove([key], n % 2 == 0, now)
        elif op == "tick":
            state.tick(now)
        elif op == "sync":
            server.sync(state, now, order=kib % 3)
        elif op in ("done", "fail"):
            for _ in range(1 if kib < 4 else len(server.staged)):  # one, or all staged
                server.finish(state, now, kib, ok=op == "done")
        elif op == "lost":
            _report_lost(state, server, key, now)
        elif op == "lose_disk" and kib == 1:
            server.lose_disk(state, now)
        elif op == "failover" and kib < 3:
            cluster.failover(now)
        cluster.check(now)


def _report_lost(state: MasterState, server: Server, key: str, now: float) -> None:
    """The server finds ``key``'s disk copy unreadable (if it has one there)."""
    slot = state.objects.index.get(key)
    disk = state.segments.by_mount.get(server.mount_id(Tier.DISK))
    if slot < 0 or disk is None:
        return
    for index, offset in state.objects.replicas(slot):
        if index == disk.index:
            report = TierReport(disk.mount_id, lost=[Moved(key, offset)])
            state.heartbeat(server.name, [], [], now, [report])
