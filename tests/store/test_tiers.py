"""The master's tiers, driven directly (pure logic, explicit clock): demotion instead of loss,
moves cancelled or cut off by a lost segment, per-tier eviction, promotion, per-tier stats."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvconnect.store.config import MasterConfig
from kvconnect.store.master.objects import MoveKind
from kvconnect.store.master.state import MasterState
from kvconnect.store.messages import (
    Change,
    Code,
    Moved,
    PutItem,
    RemovalReason,
    SegmentSpec,
    Tier,
    TierReport,
)

pytestmark = pytest.mark.usefixtures("key_table")

KiB = 1 << 10
DRAM_REGION, DISK_REGION = 7, 9


def _state(**overrides: object) -> MasterState:
    settings = {
        "lease_ttl": 10.0,
        "put_timeout": 5.0,
        "quarantine": 3.0,
        "heartbeat_ttl": 1e6,
        "high_watermark": 0.8,
        "evict_fraction": 0.3,
        "promote_window": 30.0,
        **overrides,
    }
    return MasterState(MasterConfig.from_mapping(settings), seed=1)


def _mount(
    state: MasterState,
    server: str,
    tier: Tier,
    size: int,
    host: str = "h1",
    n: int = 0,
) -> str:
    """Mount a segment of ``server``; returns its mount id."""
    name = f"{server}/disk{n}" if tier is Tier.DISK else server
    region = DISK_REGION + n if tier is Tier.DISK else DRAM_REGION
    spec = SegmentSpec(name, f"engine-{server}", region, size, host, tier)
    mount_id = f"mount-{name}"
    assert state.mount(server, mount_id, spec, 0.0) is Code.OK
    return mount_id


def _server(
    state: MasterState, dram: int = 16 * KiB, disk: int = 64 * KiB, held: tuple[str, ...] = ()
) -> tuple[str, str]:
    """One store server "s" with a DRAM and a disk segment: (dram mount, disk mount). The
    disk holds 4 KiB objects ``held`` already (as after a restart)."""
    dram_mount = _mount(state, "s", Tier.DRAM, dram)
    spec = SegmentSpec("s/disk0", "engine-s", DISK_REGION, disk, "h1", Tier.DISK)
    changes = [Change(key, n * 4096, 4 * KiB) for n, key in enumerate(held)]
    assert state.mount("s", "mount-s/disk0", spec, 0.0, changes) is Code.OK
    return dram_mount, "mount-s/disk0"


def _put(state: MasterState, key: str, size: int = 4 * KiB, now: float = 0.0) -> Code:
    placement = state.put_start("c", [PutItem(key, size)], 1, "h1", False, now)[0]
    if placement.code is not Code.OK:
        return placement.code
    return state.put_end([key], [0], [placement.put], now)[0]


def _journal(state: MasterState, mount_id: str) -> list[Change]:
    """The changes of a mount its server has not acknowledged yet."""
    return list(state.segments.by_mount[mount_id].journal)


def _moves(state: MasterState, mount_id: str) -> list[Change]:
    """The moves into a mount its server has been told of and has not reported on."""
    index = state.segments.by_mount[mount_id].index
    pending = state.objects.moves
    return [
        c for c in _journal(state, mount_id) if c.source_region and (index, c.offset) in pending
    ]


def _report(
    state: MasterState,
    mount_id: str,
    now: float,
    done: Sequence[Change] = (),
    failed: Sequence[Change] = (),
    lost: Sequence[tuple[str, int]] = (),
) -> None:
    """Server "s"'s next heartbeat, carrying the outcomes of moves into ``mount_id``."""
    report = TierReport(
        mount_id,
        done=[Moved(c.key, c.offset) for c in done],
        failed=[Moved(c.key, c.offset) for c in failed],
        lost=[Moved(key, offset) for key, offset in lost],
    )
    assert state.heartbeat("s", [], [], now, [report]) == ([], [])


def _drain(state: MasterState, now: float) -> None:
    """Every move under way completes, and the servers settle, until nothing moves."""
    for _ in range(100):
        _settle(state, now)
        if not state.objects.moves:
            return
        for move in list(state.objects.moves.values()):
            mount_id = state.segments.all[move.target.segment].mount_id
            _report(state, mount_id, now, done=[Change(move.key, move.target.offset, 0)])
    raise AssertionError("moves keep starting")


def _settle(state: MasterState, now: float) -> None:
    """Every server fetches and acknowledges its journals; leases run out."""
    state.tick(now)
    for segment in state.segments.live():
        server, mount = segment.server, segment.mount_id
        base = segment.journal_base
        _unknown, changes = state.heartbeat(server, [mount], [base], now)
        state.heartbeat(server, [mount], [base + len(changes[0].changes)], now)
    state.tick(now)


def _tiers(state: MasterState, key: str, now: float) -> list[Tier]:
    """The tiers of a key's replicas, in the order get_replicas returns them."""
    by_engine_region = {
        (s.spec.engine_segment, s.spec.region): s.tier for s in state.segments.live()
    }
    replicas = state.get_replicas([key], now)[0]
    assert replicas.code is Code.OK, key
    return [by_engine_region[(loc.segment, loc.region)] for loc in replicas.locations]


def _fill(state: MasterState, count: int = 4, now: float = 0.0) -> list[str]:
    """Put ``count`` 4 KiB objects and tick: eviction starts above 80 %."""
    keys = [f"k{i}" for i in range(count)]
    for i, key in enumerate(keys):
        assert _put(state, key, now=now + i / 100) is Code.OK
    state.tick(now + 1.0)
    return keys


def test_dram_eviction_demotes_to_the_servers_disk_and_done_moves_the_replica() -> None:
    state = _state()
    dram, disk = _server(state)
    keys = _fill(state)  # 16 KiB of 16: the round's target is down to 50 %: two objects
    moves = _moves(state, disk)
    assert len(moves) == 2
    first, second = (c.key for c in moves)
    for change in moves:
        assert change.offset % 4096 == 0, "disk space is aligned for direct I/O"
        assert (change.size, change.source_region) == (4 * KiB, DRAM_REGION)
    assert state.exists(keys) == [True] * 4, "a demoting object stays readable"
    assert _tiers(state, first, 1.0) == [Tier.DRAM], "read from DRAM meanwhile"
    assert state.removals.since("", 0, 10).removed == [], "a demotion is no removal"
    dram_segment = state.segments.by_mount[dram]
    assert (dram_segment.used, dram_segment.in_transit) == (8 * KiB, 8 * KiB)
    _report(state, disk, 2.0, done=moves)
    assert _tiers(state, first, 2.0) == [Tier.DISK]
    locations = state.get_replicas([second], 2.0)[0].locations
    assert (locations[0].region, locations[0].offset) == (DISK_REGION, moves[1].offset)
    # the DRAM copies go through the DRAM journal, as any release
    releases = [c for c in _journal(state, dram) if not c.key]
    assert sorted(c.offset for c in releases) == sorted(c.source_offset for c in moves)
    _report(state, disk, 2.0, done=moves)  # a resent report changes nothing
    stats = {t.tier: t for t in state.tier_stats()}
    assert (stats[Tier.DISK].demotions, stats[Tier.DISK].objects) == (2, 2)
    assert stats[Tier.DRAM].evictions == 2
    assert state.evictions == 0, "nothing was dropped"
    _settle(state, 20.0)
    _check_space(state)


def test_a_failed_demotion_evicts_the_object_and_releases_the_disk_space() -> None:
    state = _state()
    _dram, disk = _server(state)
    _fill(state)
    moves = _moves(state, disk)
    _report(state, disk, 2.0, failed=moves[:1], done=moves[1:])
    assert state.exists([c.key for c in moves]) == [False, True]
    assert [(r.key, r.reason) for r in state.removals.since("", 0, 10).removed] == [
        (moves[0].key, RemovalReason.EVICTED)
    ]
    released = [c.offset for c in _journal(state, disk) if not c.key]
    assert released == [moves[0].offset], "the server forgets the failed move's space"
    stats = {t.tier: t for t in state.tier_stats()}
    assert (stats[Tier.DISK].demotions, stats[Tier.DISK].demotions_failed) == (1, 1)
    assert state.evictions == 1
    _settle(state, 20.0)
    _check_space(state)


def test_a_demotion_cancelled_by_a_removal_keeps_its_spaces_until_the_outcome() -> None:
    state = _state()
    dram, disk = _server(state)
    _fill(state)
    moves = _moves(state, disk)
    gone, kept = (c.key for c in moves)
    assert state.remove([gone], False, 1.5) == [Code.OK]
    assert state.exists([gone]) == [False]
    assert [(r.key, r.reason) for r in state.removals.since("", 0, 10).removed] == [
        (gone, RemovalReason.REMOVED)
    ]
    # the DRAM server forgets k0 at once (no later master indexes it) ...
    assert Change("", moves[0].source_offset, 0) in _journal(state, dram)
    # ... but its bytes may still be being copied: that space is not reused yet
    _settle(state, 20.0)
    dram_segment = state.segments.by_mount[dram]
    assert dram_segment.in_transit == 8 * KiB, "both sources are held until the outcomes"
    disk_segment = state.segments.by_mount[disk]
    assert disk_segment.allocator.used == 8 * KiB, "the target too"
    _report(state, disk, 21.0, done=moves)
    assert _journal(state, disk)[-1] == Change("", moves[0].offset, moves[0].size)
    assert _tiers(state, kept, 21.0) == [Tier.DISK]
    _settle(state, 40.0)
    assert dram_segment.in_transit == 0
    _check_space(state)


def test_a_key_put_again_during_its_old_demotion_keeps_its_new_copy() -> None:
    state = _state()
    _dram, disk = _server(state, dram=32 * KiB)
    _fill(state, 7)  # 28 KiB of 32: three demotions (to 50 %), 4 KiB free
    moves = _moves(state, disk)
    assert len(moves) == 3
    key = moves[0].key
    assert state.remove([key], True, 1.5) == [Code.OK]
    _settle(state, 1.6)
    assert _put(state, key, 2 * KiB, now=2.0) is Code.OK
    new = state.get_replicas([key], 2.0)[0].locations
    _report(state, disk, 3.0, done=moves[:1])
    assert state.get_replicas([key], 3.0)[0].locations == new, "the old move was cancelled"
    assert state.objects.size[state.objects.index.get(key)] == 2 * KiB
    _report(state, disk, 3.0, failed=moves[1:])
    _settle(state, 30.0)
    _check_space(state)


def test_a_lost_disk_ends_its_moves_and_the_objects_stay_in_dram() -> None:
    state = _state()
    dram, disk = _server(state)
    _fill(state)
    moves = _moves(state, disk)
    assert state.unmount("s", [disk]) == [Code.OK]
    assert state.objects.moves == {}
    assert _tiers(state, moves[0].key, 2.0) == [Tier.DRAM]
    assert state.segments.by_mount[dram].in_transit == 0, "their DRAM space is used again"
    _report(state, disk, 2.0, done=moves)  # the server's stale report: ignored
    state.tick(2.0)
    assert state.exists([c.key for c in moves]) == [True, True]
    _settle(state, 20.0)
    _check_space(state)


def test_a_lost_dram_segment_cancels_its_demotions_and_their_disk_space_returns() -> None:
    state = _state()
    dram, disk = _server(state)
    keys = _fill(state)
    moves = _moves(state, disk)
    assert state.unmount("s", [dram]) == [Code.OK]
    state.tick(2.0)
    assert state.exists(keys) == [False] * 4
    reasons = {r.key: r.reason for r in state.removals.since("", 0, 10).removed}
    assert reasons == dict.fromkeys(keys, RemovalReason.LOST)
    disk_segment = state.segments.by_mount[disk]
    assert disk_segment.allocator.used == 8 * KiB, "held until the server's outcome"
    _report(state, disk, 3.0, done=moves[:1], failed=moves[1:])
    assert [c.offset for c in _journal(state, disk) if not c.key] == [m.offset for m in moves]
    _settle(state, 4.0)
    assert disk_segment.allocator.used == 0


def test_dram_eviction_of_a_disk_resident_object_drops_only_its_dram_copy() -> None:
    state = _state(high_watermark=0.9, evict_fraction=0.9)
    dram, disk = _server(state, held=("k",))
    state.get_replicas(["k"], 1.0)
    state.get_replicas(["k"], 2.0)  # a second hit within the window: promoted
    _report(state, dram, 3.0, done=_moves(state, dram))
    assert _tiers(state, "k", 3.0) == [Tier.DRAM, Tier.DISK]
    _settle(state, 20.0)
    for i in range(3):  # fill DRAM past the watermark: every object goes (low mark 0)
        assert _put(state, f"new{i}", now=21.0 + i) is Code.OK
    slot = state.objects.index.get("k")
    for step in range(100):
        state.tick(30.0 + step)
        if state.segments.disk[state.objects.segment[slot]]:
            break
    assert "k" not in [c.key for c in _moves(state, disk)], "no demotion: it has a disk copy"
    assert _tiers(state, "k", 200.0) == [Tier.DISK]
    assert state.removals.since("", 0, 10).removed == []
    _drain(state, 250.0)
    _check_space(state)


def test_each_disk_segment_evicts_by_its_own_watermark() -> None:
    state = _state(high_watermark=0.5, evict_fraction=0.25)
    dram, disk = _server(state, dram=64 * KiB, disk=32 * KiB)
    now = 0.0
    for i in range(40):  # puts past DRAM's watermark demote; disk fills past its own
        now += 0.1
        assert _put(state, f"k{i}", now=now) is Code.OK
        _drain(state, now)
    disk_segment = state.segments.by_mount[disk]
    assert disk_segment.used <= 0.5 * disk_segment.allocator.capacity + 4 * KiB
    stats = {t.tier: t for t in state.tier_stats()}
    assert stats[Tier.DISK].evictions > 0
    assert stats[Tier.DISK].demotions >= stats[Tier.DISK].evictions
    evicted = state.removals.since("", 0, 100).removed
    assert evicted
    assert {r.reason for r in evicted} == {RemovalReason.EVICTED}
    assert state.evictions == len(evicted) == stats[Tier.DISK].evictions
    dram_segment = state.segments.by_mount[dram]
    assert dram_segment.used <= 0.5 * dram_segment.allocator.capacity + 4 * KiB
    _drain(state, now + 20.0)
    _check_space(state)


def test_no_disk_room_or_too_many_demotions_in_flight_drops_as_without_a_disk() -> None:
    state = _state(demotion_inflight=4 * KiB)
    _dram, disk = _server(state, disk=8 * KiB)
    keys = _fill(state)
    assert len(_moves(state, disk)) == 1, "then the in-flight bound"
    assert sum(state.exists(keys)) == 3
    assert state.evictions == 1
    _drain(state, 2.0)
    _check_space(state)


def test_a_full_disk_drops_as_without_one() -> None:
    state = _state(high_watermark=1.0, evict_fraction=0.25)  # evict on NO_SPACE only
    _dram, disk = _server(state, disk=4 * KiB)
    _fill(state)
    assert _put(state, "k4", now=1.0) is Code.NO_SPACE  # a round of one object starts
    state.tick(1.1)
    assert len(_moves(state, disk)) == 1
    _drain(state, 1.2)
    assert _put(state, "k4", now=1.3) is Code.OK
    assert _put(state, "k5", now=1.4) is Code.NO_SPACE
    state.tick(1.5)
    assert _moves(state, disk) == [], "the disk is full"
    assert state.evictions == 1
    assert state.removals.since("", 0, 10).removed[0].reason is RemovalReason.EVICTED


def test_a_second_hit_within_the_window_promotes_and_a_scan_does_not() -> None:
    state = _state()
    dram, _disk = _server(state, dram=64 * KiB, held=("k0", "k1", "k2", "k3"))
    for i in range(4):  # a scan: every key once (the first reads since the restart)
        assert _tiers(state, f"k{i}", 100.0) == [Tier.DISK]
    assert _moves(state, dram) == []
    state.get_replicas(["k0"], 200.0)  # again, but long after
    assert _moves(state, dram) == []
    assert _tiers(state, "k0", 201.0) == [Tier.DISK], "this read is served from disk"
    (move,) = _moves(state, dram)
    assert (move.key, move.source_region) == ("k0", DISK_REGION)
    assert state.objects.moving[state.objects.index.get("k0")].kind is MoveKind.PROMOTE
    state.get_replicas(["k0"], 202.0)
    assert len(_moves(state, dram)) == 1, "one promotion at a time"
    _report(state, dram, 203.0, done=[move])
    assert _tiers(state, "k0", 203.0) == [Tier.DRAM, Tier.DISK], "DRAM first, disk kept"
    assert _journal(state, dram)[-1] == Change("k0", move.offset, move.size), "committed"
    stats = {t.tier: t for t in state.tier_stats()}
    assert stats[Tier.DRAM].promotions == 1
    assert stats[Tier.DISK].hits == 4 + 1 + 2  # the scan, the late read, the second hits
    _settle(state, 230.0)
    _check_space(state)


def test_no_free_dram_no_promotion_and_a_failed_one_changes_nothing() -> None:
    state = _state(high_watermark=0.9)
    dram, _disk = _server(state, held=("cold",))
    for i in range(3):
        assert _put(state, f"hot{i}", now=1.0) is Code.OK
    state.get_replicas(["cold"], 2.0)
    state.get_replicas(["cold"], 3.0)
    assert _moves(state, dram) == [], "promotion evicts nothing: 16 KiB would exceed 90 %"
    state.remove(["hot0"], True, 3.0)
    _settle(state, 20.0)
    state.get_replicas(["cold"], 21.0)
    (move,) = _moves(state, dram)
    _report(state, dram, 22.0, failed=[move])
    assert state.segments.by_mount[dram].used == 8 * KiB, "its DRAM space went back"
    assert _tiers(state, "cold", 22.0) == [Tier.DISK]
    again = _moves(state, dram)[-1]  # read within the window again: another try, same space
    _report(state, dram, 22.0, done=[again])
    _settle(state, 40.0)
    _check_space(state)


def test_replicas_come_dram_first_then_the_readers_host() -> None:
    state = _state()
    _mount(state, "a", Tier.DRAM, 16 * KiB, host="h1")
    disk_a = _mount(state, "a", Tier.DISK, 64 * KiB, host="h1")
    _mount(state, "b", Tier.DRAM, 16 * KiB, host="h2")
    placement = state.put_start("c", [PutItem("k", 4 * KiB)], 2, "h1", False, 0.0)[0]
    assert state.put_end(["k"], [0], [placement.put], 0.0) == [Code.OK]
    # a's disk reports a copy too (a restart of its disk segment), mounted after the DRAM ones
    spec = SegmentSpec("a/disk1", "engine-a", DISK_REGION, 64 * KiB, "h1", Tier.DISK)
    assert state.mount("a", "m-a-disk1", spec, 0.0, [Change("k", 0, 4 * KiB)]) is Code.OK
    assert disk_a
    for host, first in (("h1", "engine-a"), ("h2", "engine-b")):
        locations = state.get_replicas(["k"], 1.0, host)[0].locations
        assert locations[0].segment == first
        assert locations[-1].region == DISK_REGION, "disk last"


def test_a_lost_report_drops_the_replica_and_the_object_with_its_last_one() -> None:
    state = _state()
    dram, disk = _server(state, dram=64 * KiB, held=("only", "both"))
    state.get_replicas(["both"], 1.0)
    state.get_replicas(["both"], 2.0)
    _report(state, dram, 3.0, done=_moves(state, dram))
    assert _tiers(state, "both", 3.0) == [Tier.DRAM, Tier.DISK]
    _report(state, disk, 4.0, lost=[("only", 0), ("both", 4096)])
    _report(state, disk, 4.0, lost=[("only", 0)])  # again: ignored
    assert state.exists(["only", "both"]) == [False, True]
    assert _tiers(state, "both", 4.0) == [Tier.DRAM]
    assert [(r.key, r.reason) for r in state.removals.since("", 0, 10).removed] == [
        ("only", RemovalReason.LOST)
    ]
    assert {t.tier: t for t in state.tier_stats()}[Tier.DISK].lost == 2
    _settle(state, 20.0)
    _check_space(state)


def test_a_restarted_disk_reports_its_objects_as_replicas() -> None:
    state = _state()
    _mount(state, "s", Tier.DRAM, 16 * KiB)
    spec = SegmentSpec("s/disk0", "engine-s", DISK_REGION, 64 * KiB, "h1", Tier.DISK)
    held = [Change("a", 0, 4 * KiB), Change("b", 4096, 100), Change("bad", 6000, 64)]
    assert state.mount("s", "m-disk", spec, 0.0, held) is Code.OK
    assert state.exists(["a", "b", "bad"]) == [True, True, False]
    assert _tiers(state, "a", 1.0) == [Tier.DISK]
    assert state.segments.by_mount["m-disk"].allocator.used == 2 * 4096
    state.get_replicas(["a"], 2.0)  # the first read after the restart was its second
    assert [c.key for c in _moves(state, "mount-s")] == ["a"]


def _check_space(state: MasterState) -> None:
    """Settled (no moves, everything acknowledged, leases over): every allocated byte is an
    object's (rounded) footprint, and bytes_stored the objects' sizes."""
    objects = state.objects
    assert objects.moves == {}
    assert objects.moving == {}
    footprint: dict[int, int] = {}
    stored = 0
    for _key, slot in objects.items():
        stored += objects.size[slot]
        for replica in objects.replicas(slot):
            length = state.segments.all[replica.segment].allocator.length(objects.size[slot])
            footprint[replica.segment] = footprint.get(replica.segment, 0) + length
    assert stored == state.bytes_stored
    for segment in state.segments.live():
        assert segment.in_transit == 0, segment.spec.name
        assert segment.allocator.used == footprint.get(segment.index, 0), segment.spec.name


def test_a_read_during_a_demotion_keeps_its_dram_bytes_until_the_lease_ends() -> None:
    state = _state()
    dram, disk = _server(state)
    _fill(state)
    moves = _moves(state, disk)
    read = state.get_replicas([moves[0].key], 1.5)[0].locations  # leased until 11.5
    assert read[0].region == DRAM_REGION
    _report(state, disk, 2.0, done=moves)
    _settle(state, 2.0)
    segment = state.segments.by_mount[dram]
    assert segment.in_transit == 4 * KiB, "the read's DRAM copy is not reused under its lease"
    _settle(state, 12.0)
    assert segment.in_transit == 0
    _check_space(state)


def test_a_demoting_copy_reported_unreadable_loses_the_object_and_no_space() -> None:
    state = _state()
    dram, disk = _server(state)
    _fill(state)
    moves = _moves(state, disk)
    _report(state, dram, 1.5, lost=[(moves[0].key, moves[0].source_offset)])
    assert state.exists([moves[0].key]) == [False]
    _report(state, disk, 2.0, done=moves)
    assert _tiers(state, moves[1].key, 2.0) == [Tier.DISK]
    _settle(state, 20.0)
    _check_space(state)
