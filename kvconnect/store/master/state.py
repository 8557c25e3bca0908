"""The master's state machine: objects, segments, leases, pins, pending puts, eviction, tiers.

Pure: no sockets, threads or clock. The service passes ``now`` (seconds on a monotonic clock
starting near zero) to every call and runs :meth:`MasterState.tick` between requests; each tick
does a bounded amount of background work, so no request waits long behind it.

Tiers (docs/store.md): puts go to DRAM segments. DRAM eviction *demotes* an object to a disk
segment of the same store server when it can (a move: the server copies the bytes and
reports the outcome), and each disk segment evicts by its own watermark. A disk-only object
read twice within ``promote_window`` is copied back into free DRAM of its server. An object's
replicas are kept DRAM first, so its primary replica tells its best tier.
"""

from __future__ import annotations

import itertools
import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

from kvconnect.store.config import MasterConfig, Strategy
from kvconnect.store.master import eviction
from kvconnect.store.master.moves import Mover, TierCounters
from kvconnect.store.master.objects import ObjectTable, Pending, Replica, State
from kvconnect.store.master.removals import RemovalLog
from kvconnect.store.master.segments import Segment, SegmentTable
from kvconnect.store.master.tenants import NONE, Tenants, within
from kvconnect.store.messages import (
    MAX_STORED_KEY_BYTES,
    Change,
    Changes,
    Code,
    Location,
    Moved,
    Placement,
    PutItem,
    RemovalReason,
    Replicas,
    SegmentSpec,
    SegmentStats,
    TenantStats,
    Tier,
    TierReport,
    TierStats,
    check_key,
)

MAX_PARTS = 64
_CLEANUP_STEP = 4096  # objects of lost segments cleaned per tick
_EXPIRY_SCAN = 0.25  # seconds between scans for timed-out puts
_COMPLETE = int(State.COMPLETE)
PIN_PUT_TIMEOUTS = 60
"""How long a soft pin (``PutStart.pin``) lasts, in ``MasterConfig.put_timeout``: 60 of the
default 30 s is half an hour. A pin is a preference of eviction, not a guarantee (pinned
objects go when nothing else is eligible), so it is tied to the put timeout rather than made a
setting of its own: a store tuned for slow writers keeps what they pinned longer too."""


def _new(item: PutItem) -> bool:
    """Whether an item may be stored (its key absent): a valid key (under a tenant's prefix
    or not), size and part count."""
    return (
        check_key(item.key, MAX_STORED_KEY_BYTES) and item.size > 0 and 1 <= item.parts <= MAX_PARTS
    )


class MasterState:
    """All master metadata; see the module docstring."""

    def __init__(self, config: MasterConfig, seed: int | None = None) -> None:
        self.config = config
        self.objects = ObjectTable(config.native)
        self.segments = SegmentTable(config.allocation, config.alignment, seed)
        self.objects.disk_segments = self.segments.disk  # the tier of a tenant's bytes
        self._servers: dict[str, float] = {}
        self._next_expiry_scan = 0.0
        self._cleanup: list[int] = []  # slots that referenced a lost segment
        self._lost: list[int] = []  # lost segment indices awaiting a cleanup scan
        self._evict_target = 0  # bytes still to evict in the current DRAM round
        self._disk_targets: dict[int, int] = {}  # per disk segment index: its round's bytes
        self._rng = np.random.default_rng(seed)
        # Put ids: consecutive from a random start, so two masters (a restart, a failover)
        # practically never hand out the same id.
        self._put_ids = itertools.count(secrets.randbits(62))
        self.bytes_stored = 0
        self.evictions = 0  # objects eviction dropped (any tier; a demotion is no drop)
        self.evicted_bytes = 0  # capacity eviction freed (any tier)
        self.counters = [TierCounters() for _ in Tier]  # by tier value
        self.mover = Mover(config, self.objects, self.segments, self.counters)
        self.removals = RemovalLog()
        """Complete objects that stopped existing (removed, evicted, lost)."""
        self.tenants = Tenants(config.tenants)
        self.tenant_evictions: Counter[int] = Counter()  # objects of each tenant evicted
        self._tenant_targets: dict[int, int] = {}  # memory bytes each tenant's quota must free

    # ------------------------------------------------------------------------------ segments

    def mount(
        self,
        server: str,
        mount_id: str,
        spec: SegmentSpec,
        now: float,
        held: Sequence[Change] = (),
        more: bool = False,
    ) -> Code:
        """Mount a segment; a new mount of a known name replaces (and loses) the old one.

        ``held``: objects the segment holds already (its server learned them from a previous
        master's journal), in offset order; ``more``: :meth:`report` sends the rest, and
        nothing is allocated in the segment until then. A repeated mount (a lost reply) is OK.
        """
        if spec.size <= 0 or not spec.name or not spec.engine_segment:
            return Code.INVALID
        self._servers[server] = now
        if mount_id in self.segments.by_mount:
            return Code.OK
        previous = self.segments.by_name.get(spec.name)
        if previous is not None:
            self._lose(previous)
        segment = self.segments.mount(server, mount_id, spec, recovering=bool(held) or more)
        if segment.recovering is None:
            return Code.OK
        return self.report(server, mount_id, held, more, now)

    def report(
        self, server: str, mount_id: str, held: Sequence[Change], more: bool, now: float
    ) -> Code:
        """Objects a recovering segment holds (see :meth:`mount`). Entries out of order,
        misaligned or outside the segment are ignored (a repeated report is harmless)."""
        segment = self.segments.by_mount.get(mount_id)
        if segment is None or segment.server != server:
            return Code.UNKNOWN_SEGMENT
        if segment.recovering is None:
            return Code.OK  # already complete: a repeated last report
        for change in held:
            if change.key and self.segments.adopt(segment, change.offset, change.size):
                self._recover(segment, change, now)
            elif Replica(segment.index, change.offset) not in self._replicas_of(change.key):
                segment.forget(change.offset)  # unusable (not a repeat): the server drops it
        if not more:
            self.segments.recovered(segment)
        return Code.OK

    def _recover(self, segment: Segment, change: Change, now: float) -> None:
        """Index a reported object: a new key, or one more replica of a stored one. A copy the
        index cannot use (the key is being written again, or has another size) is released."""
        objects = self.objects
        slot = objects.index.get(change.key)
        if slot >= 0 and objects.state[slot] == State.COMPLETE and not self._readable(slot):
            self._free(slot, now, None)  # its replicas were lost: this copy replaces them
            slot = -1
        if slot < 0:
            tenant = self.tenants.id_of_key(change.key)
            slot = objects.add(change.key, change.size, segment.index, change.offset, 0.0, tenant)
            objects.state[slot] = _COMPLETE
            # Not "accessed" within the promotion window: a scan after a restart promotes none.
            objects.access[slot] = now - self.config.promote_window
            self.bytes_stored += change.size
            return
        replicas = objects.replicas(slot)
        usable = (
            objects.state[slot] == State.COMPLETE
            and objects.size[slot] == change.size
            and all(replica.segment != segment.index for replica in replicas)
        )
        if usable:
            added = [*replicas, Replica(segment.index, change.offset)]
            objects.set_replicas(slot, self.segments.dram_first(added))
        else:
            self.segments.release(segment.index, change.offset, change.size, committed=True)

    def unmount(self, server: str, mount_ids: Sequence[str]) -> list[Code]:
        """Retire segments at their server's request."""
        codes = []
        for mount_id in mount_ids:
            segment = self.segments.by_mount.get(mount_id)
            if segment is None or segment.server != server:
                codes.append(Code.UNKNOWN_SEGMENT)
                continue
            self._lose(segment)
            codes.append(Code.OK)
        return codes

    def heartbeat(
        self,
        server: str,
        mount_ids: Sequence[str],
        applied: Sequence[int],
        now: float,
        reports: Sequence[TierReport] = (),
    ) -> tuple[list[str], list[Changes]]:
        """Record liveness, the server's tier reports (moves done or failed, objects lost;
        see :meth:`tier_report`) and the journal changes each mount has applied; returns the
        mount ids the master does not know (remount them) and the changes each mount still
        lacks."""
        self._servers[server] = now
        for report in reports:
            self.tier_report(server, report, now)
        unknown = []
        changes = []
        for mount_id, count in zip(mount_ids, applied, strict=True):
            segment = self.segments.by_mount.get(mount_id)
            if segment is None or segment.server != server:
                unknown.append(mount_id)
            else:
                changes.append(self.segments.acknowledge(segment, count, now))
        return unknown, changes

    def _lose(self, segment: Segment) -> None:
        # Synchronous part: no more allocation there, no more replicas returned from there,
        # no move into or out of it.
        self.segments.retire(segment)
        self._lost.append(segment.index)
        self.mover.drop(segment.index)

    # ------------------------------------------------------------------------------- objects

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is a complete object with a live replica."""
        # The hot lookup: one call for the batch (index and columns); a primary on a lost
        # segment, whose other replicas decide, is the rare case.
        objects = self.objects
        found = objects.index.live_many(
            keys, objects.state, _COMPLETE, objects.segment, self.segments.alive
        )
        if None not in found:
            return cast(list[bool], found)
        get = objects.index.get
        return [
            self._readable(get(k)) if f is None else f for k, f in zip(keys, found, strict=True)
        ]

    def put_start(
        self,
        client: str,
        items: Sequence[PutItem],
        replicas: int,
        host_id: str,
        pin: bool,
        now: float,
        tenant: int = NONE,
    ) -> list[Placement]:
        """Allocate space for new objects of ``tenant`` (their keys under its prefix); EXISTS
        for stored ones, a shared placement for the other parts of a multi-part put, NO_SPACE
        for those over the tenant's quota (its own oldest objects are evicted for them)."""
        pin_until = now + self.config.put_timeout * PIN_PUT_TIMEOUTS if pin else 0.0
        results: list[Placement | None] = []
        seen: set[str] = set()
        index = self.objects.index
        for item, slot in zip(items, index.get_many([item.key for item in items]), strict=True):
            key = item.key
            if key in seen:  # its slot may have gone since the batched lookup; the second waits
                result = self._admit(item, replicas, index.get(key)) or Placement(Code.BUSY, [])
            elif slot < 0 and _new(item) and replicas >= 1:  # the common case: a new object
                result = None
            else:
                result = self._admit(item, replicas, slot)
            seen.add(key)
            results.append(result)
        fresh = [n for n, result in enumerate(results) if result is None]
        if self.tenants.quota(tenant):
            fresh = self._within_quota(tenant, items, fresh, results)
        placed = self._place_batch(client, host_id, [items[n].size for n in fresh], replicas)
        stored = [n for n, where in zip(fresh, placed, strict=True) if where]
        for n, where in zip(fresh, placed, strict=True):
            if not where:
                results[n] = Placement(self._no_room(items[n].size, replicas), [])
        where_of = [where for where in placed if where]
        slots = self.objects.add_many(
            [items[n].key for n in stored],
            [items[n].size for n in stored],
            [where[0] for where in where_of],
            pin_until,
            tenant,
        )
        deadline = now + self.config.put_timeout
        pending, put_ids, segments = self.objects.pending, self._put_ids, self.segments.all
        for n, slot, where in zip(stored, slots, where_of, strict=True):
            put = next(put_ids)
            pending[slot] = Pending(client, items[n].parts, 0, deadline, put)
            if len(where) > 1:
                self.objects.extra[slot] = where[1:]
                results[n] = Placement(Code.OK, self._locations(where), put)
                continue
            spec = segments[where[0].segment].spec  # one replica, the common case
            location = Location(spec.engine_segment, spec.region, where[0].offset)
            results[n] = Placement(Code.OK, [location], put)
        return [r for r in results if r is not None]

    def _within_quota(
        self,
        tenant: int,
        items: Sequence[PutItem],
        fresh: list[int],
        results: list[Placement | None],
    ) -> list[int]:
        """Of ``fresh`` (new objects of ``tenant``), those its quota admits, in order; the
        others are answered NO_SPACE and the tenant's oldest objects evicted for them."""
        sizes = [items[n].size for n in fresh]
        room = self.tenants.quota(tenant) - self.objects.tenant_memory(tenant)
        fits = within(room, sizes)
        admitted = [n for n, ok in zip(fresh, fits, strict=True) if ok]
        refused = sum(size for size, ok in zip(sizes, fits, strict=True) if not ok)
        for n, ok in zip(fresh, fits, strict=True):
            if not ok:
                results[n] = Placement(Code.NO_SPACE, [])
        if refused:
            wanted = min(refused, self.objects.tenant_memory(tenant))
            self._tenant_targets[tenant] = max(self._tenant_targets.get(tenant, 0), wanted)
        return admitted

    def _place_batch(
        self, client: str, host_id: str, sizes: list[int], replicas: int
    ) -> list[list[Replica]]:
        """Placements for new objects, contiguous per batch where the strategy keeps a writer
        on one segment (``local_first``); [] for an object that does not fit anywhere."""
        if not sizes:
            return []
        if self.segments.strategy is Strategy.LOCAL_FIRST:
            # The common case: the writer's first choice takes the whole batch, in one search.
            order = self.segments.order(client, host_id)
            run = self.segments.place_run(order[:replicas], sizes) if order else None
            if run is not None:
                return run
        placed = []
        for size in sizes:  # per object: spread (random, free_ratio) or fill gaps
            order = self.segments.order(client, host_id)
            placed.append(self.segments.place(order, size, replicas))
        return placed

    def _admit(self, item: PutItem, replicas: int, slot: int) -> Placement | None:
        """The answer for an item (its key at ``slot``, -1: absent) that needs no new
        allocation, or None to allocate."""
        if not _new(item) or replicas < 1:
            return Placement(Code.INVALID, [])
        if slot < 0:
            return None
        if self.objects.state[slot] == State.COMPLETE:
            if self._readable(slot):
                return Placement(Code.EXISTS, [])
            self._free(slot, 0.0, RemovalReason.LOST)  # every replica was lost: write it again
            return None
        pending = self.objects.pending[slot]
        if item.parts > 1 and item.parts == pending.parts and item.size == self.objects.size[slot]:
            locations = self._locations(self.objects.replicas(slot))
            return Placement(Code.OK, locations, pending.put)  # join
        return Placement(Code.BUSY, [])

    def _no_room(self, size: int, replicas: int) -> Code:
        """The answer to a put that fits nowhere right now.

        BUSY (retry) when space in transit — released, awaiting its server's acknowledgement,
        a read lease or the put quarantine — would hold it once back: that space returns by
        itself, so nothing is evicted for it (and an eviction round already under way is not
        stacked with another one while its space comes back). Otherwise NO_SPACE, and a round
        evicts room for ``replicas`` copies, which serves the next put of this size — but never
        below the eviction target (free space too fragmented for a large object, or an object
        larger than what eviction may free, is not worth emptying the store for).
        """
        length = self.segments.length(size)
        if self.segments.returning(length):
            return Code.BUSY
        used, capacity = self.segments.capacity(Tier.DRAM)
        wanted = min(length * replicas, int(used - self._low_mark(capacity)))
        self._evict_target = max(self._evict_target, wanted)
        return Code.NO_SPACE

    def put_end(
        self, keys: Sequence[str], parts: Sequence[int], puts: Sequence[int], now: float
    ) -> list[Code]:
        """Mark parts of puts written; an object completes when all its parts are in. The
        end of a put that is no longer pending (it timed out and the key was put again) is
        DISCARDED."""
        objects = self.objects
        index, state, primary = objects.index, objects.state, objects.segment
        alive, segments = self.segments.alive, self.segments.all
        codes = []
        for key, part, put in zip(keys, parts, puts, strict=True):
            slot = index.get(key)  # one by one: a part may free its key's slot
            if slot < 0:
                codes.append(Code.DISCARDED)
                continue
            if state[slot] == _COMPLETE:
                codes.append(Code.OK)  # a repeated put_end: idempotent
                continue
            pending = objects.pending[slot]
            if pending.put != put:
                codes.append(Code.DISCARDED)
                continue
            if not 0 <= part < pending.parts:
                codes.append(Code.INVALID)
                continue
            if not alive[primary[slot]] and not self._readable(slot):
                self._free(slot, now, None)  # pending: never stored
                codes.append(Code.DISCARDED)
                continue
            pending.done_mask |= 1 << part
            if pending.done_mask == (1 << pending.parts) - 1:
                state[slot] = _COMPLETE
                objects.access[slot] = now
                del objects.pending[slot]
                size = objects.size[slot]
                self.bytes_stored += size
                segments[primary[slot]].commit(key, objects.offset[slot], size)
                for replica in objects.extra.get(slot, ()):  # the others (one: the usual case)
                    segments[replica.segment].commit(key, replica.offset, size)
            codes.append(Code.OK)
        return codes

    def put_revoke(self, keys: Sequence[str], puts: Sequence[int], now: float) -> list[Code]:
        """Give up pending puts (their space is quarantined, then reused)."""
        codes = []
        for key, put in zip(keys, puts, strict=True):
            slot = self.objects.index.get(key)
            if (
                slot < 0
                or self.objects.state[slot] != State.PENDING
                or self.objects.pending[slot].put != put
            ):
                codes.append(Code.NOT_FOUND)
                continue
            self._discard(slot, now)
            codes.append(Code.OK)
        return codes

    def get_replicas(self, keys: Sequence[str], now: float, host_id: str = "") -> list[Replicas]:
        """Live replicas of complete objects, each granted a read lease of ``lease_ttl``.

        DRAM replicas come before disk ones, then those on the reader's host (``host_id``).
        A disk-only object read again within ``promote_window`` of its previous read starts a
        promotion (this read is served from disk).
        """
        objects = self.objects
        state, primary, offsets = objects.state, objects.segment, objects.offset
        sizes, leases, access, extra = objects.size, objects.lease, objects.access, objects.extra
        alive, disk, segments = self.segments.alive, self.segments.disk, self.segments.all
        lease = now + self.config.lease_ttl
        promote_window = self.config.promote_window
        missing = Replicas(Code.NOT_FOUND, 0, [])
        reads = [0, 0]  # per tier (DRAM, disk): counted once per call
        results: list[Replicas] = []
        for slot in objects.index.get_many(keys):  # a read drops no object: slots stay valid
            if slot < 0 or state[slot] != State.COMPLETE:
                results.append(missing)
                continue
            if slot in extra:
                live = self._live(slot)
                if not live:
                    results.append(missing)
                    continue
                live.sort(key=self._read_order(host_id))
                segment, offset = live[0]
                locations = self._locations(live)
            else:  # one replica, the common case: no lists of Replica to build
                segment, offset = primary[slot], offsets[slot]
                if not alive[segment]:
                    results.append(missing)
                    continue
                spec = segments[segment].spec
                locations = [Location(spec.engine_segment, spec.region, offset)]
            leases[slot] = lease
            tier = disk[segment]
            reads[tier] += 1
            if tier and now - access[slot] < promote_window:
                self.mover.promote(slot, Replica(segment, offset))
            access[slot] = now
            results.append(Replicas(Code.OK, sizes[slot], locations))
        for tier, count in enumerate(reads):
            self.counters[tier].hits += count
        return results

    def _read_order(self, host_id: str) -> Callable[[Replica], tuple[int, bool]]:
        """Sort key of replicas for a reader: DRAM first, then the reader's host first."""
        disk = self.segments.disk
        segments = self.segments.all
        return lambda r: (disk[r.segment], segments[r.segment].spec.host_id != host_id)

    def remove(self, keys: Sequence[str], force: bool, now: float) -> list[Code]:
        """Remove objects; BUSY while leased or pending unless ``force``."""
        objects = self.objects
        codes = []
        for key in keys:
            slot = objects.index.get(key)  # one by one: a removal frees its slot
            if slot < 0:
                codes.append(Code.NOT_FOUND)
            elif not force and (objects.state[slot] == State.PENDING or objects.lease[slot] > now):
                codes.append(Code.BUSY)
            else:
                self._free(slot, now, RemovalReason.REMOVED)
                codes.append(Code.OK)
        return codes

    # ---------------------------------------------------------------------------- reporting

    def stats(self) -> tuple[int, int, list[SegmentStats]]:
        """(complete keys, pending puts, per-segment stats)."""
        segments = [
            SegmentStats(
                name=s.spec.name,
                host_id=s.spec.host_id,
                server=s.server,
                capacity=s.allocator.capacity,
                used=s.used,
                objects=s.objects,
                backlog=len(s.journal),
                in_transit=s.in_transit,
                tier=s.tier,
            )
            for s in self.segments.live()
        ]
        pending = len(self.objects.pending)
        return len(self.objects) - pending, pending, segments

    def tenant_stats(self, only: int | None = None) -> list[TenantStats]:
        """Every tenant's usage (or only tenant ``only``'s)."""
        return self.tenants.stats(self.objects, self.tenant_evictions, only)

    def tier_stats(self) -> list[TierStats]:
        """Per tier that has live segments or counted events: usage and counters."""
        result = []
        live = self.segments.live()
        for tier in Tier:
            counters = self.counters[tier]
            segments = [s for s in live if s.tier is tier]
            if not segments and counters == TierCounters():
                continue
            result.append(
                TierStats(
                    tier=tier,
                    capacity=sum(s.allocator.capacity for s in segments),
                    used=sum(s.used for s in segments),
                    objects=sum(s.objects for s in segments),
                    hits=counters.hits,
                    demotions=counters.demotions,
                    demotions_failed=counters.demotions_failed,
                    promotions=counters.promotions,
                    evictions=counters.evictions,
                    lost=counters.lost,
                )
            )
        return result

    # ---------------------------------------------------------------------------- background

    def tick(self, now: float) -> None:
        """One bounded step of background work: expiries, cleanup, eviction."""
        self._expire_servers(now)
        self._expire_puts(now)
        self.segments.reuse_due(now)
        self._cleanup_lost()
        self._evict(now)

    def busy(self) -> bool:
        """Whether background work is waiting (the service then ticks without sleeping)."""
        return bool(
            self._cleanup
            or self._lost
            or self._evict_target > 0
            or self._disk_targets
            or self._tenant_targets
        )

    def _expire_servers(self, now: float) -> None:
        ttl = self.config.heartbeat_ttl
        for server, seen in list(self._servers.items()):
            if now - seen > ttl:
                del self._servers[server]
                for segment in self.segments.live():
                    if segment.server == server:
                        self._lose(segment)

    def _expire_puts(self, now: float) -> None:
        # Pending puts are the ones in flight: few, so a periodic scan is cheaper than keeping
        # a deadline entry per put (which costs ~100 bytes per object at high put rates).
        if now < self._next_expiry_scan:
            return
        self._next_expiry_scan = now + _EXPIRY_SCAN
        expired = [slot for slot, p in self.objects.pending.items() if p.deadline <= now]
        for slot in expired:
            self._discard(slot, now)

    def _cleanup_lost(self) -> None:
        if self._lost and not self._cleanup:
            lost = np.asarray(self._lost, dtype=np.int32)
            self._lost.clear()
            with self.objects.columns() as columns:
                hits = np.isin(columns["segment"], lost) & (columns["state"] != State.FREE)
                self._cleanup = np.nonzero(hits)[0].tolist()
            lost_set = set(lost.tolist())
            self._cleanup += [
                slot
                for slot, more in self.objects.extra.items()
                if any(replica.segment in lost_set for replica in more)
            ]
        for _ in range(min(_CLEANUP_STEP, len(self._cleanup))):
            self._drop_lost_replicas(self._cleanup.pop())

    def _drop_lost_replicas(self, slot: int) -> None:
        if self.objects.state[slot] == State.FREE:
            return
        replicas = self.objects.replicas(slot)
        live = [replica for replica in replicas if self.segments.all[replica.segment].alive]
        if len(live) == len(replicas):
            return
        for replica in replicas:
            segment = self.segments.all[replica.segment]
            if not segment.alive:
                segment.objects -= 1
                self.counters[segment.tier].lost += 1
        if live:
            self.objects.set_replicas(slot, live)
            return
        if self.objects.state[slot] == State.COMPLETE:
            self.bytes_stored -= self.objects.size[slot]
            self._log_removal(slot, RemovalReason.LOST)
        self.objects.drop(slot)

    def _evict(self, now: float) -> None:
        # ``used`` counts stored objects, pending puts and moves, not space in transit: a round
        # ends with the usage at its target, and the space it freed coming back starts no
        # other. DRAM evicts over all DRAM segments (a put may go to any); each disk segment
        # on its own (only its server's DRAM demotes into it).
        used, capacity = self.segments.capacity(Tier.DRAM)
        if self._evict_target <= 0 and used > self.config.high_watermark * capacity:
            self._evict_target = int(used - self._low_mark(capacity))
        if self._evict_target > 0:
            freed = self._evict_step(now, self.config.eviction_step, self._evict_target, None)
            self._evict_target = self._evict_target - freed if freed else 0
        for segment in self.segments.by_name.values():
            if segment.tier is Tier.DISK and segment.recovering is None:
                self._evict_disk(segment, now)
        for tenant, target in list(self._tenant_targets.items()):
            freed = self._evict_tenant(tenant, target, now, disk=False)
            if freed and target > freed:
                self._tenant_targets[tenant] = target - freed
            else:
                del self._tenant_targets[tenant]
        for tenant in self.tenants.with_disk_quota():
            over = self.objects.tenant_disk[tenant] - self.tenants.disk_quota(tenant)
            if over > 0:
                self._evict_tenant(tenant, over, now, disk=True)

    def _evict_tenant(self, tenant: int, target: int, now: float, *, disk: bool) -> int:
        """Evict up to ``eviction_step`` of ``tenant``'s objects in memory (demoted to disk
        when they can be, as any DRAM eviction) or on disk (dropped), least recently used
        first, until ``target`` bytes of that quota are free: a tenant over its quota makes
        room from its own objects only. Returns the bytes freed in that tier."""
        freed = 0
        picked = eviction.tenant_candidates(
            self.objects, self.segments, self._rng, tenant, now, self.config.eviction_step, disk
        )
        for slot in picked:
            if freed >= target:
                break
            if not disk:
                freed += self._evict_from_dram(slot, now)
                continue
            freed += self.objects.size[slot]
            self._free(slot, now, RemovalReason.EVICTED)
            self.evictions += 1
        return freed

    def _evict_disk(self, segment: Segment, now: float) -> None:
        target = self._disk_targets.pop(segment.index, 0)
        capacity = segment.allocator.capacity
        if target <= 0 and segment.used > self.config.high_watermark * capacity:
            target = int(segment.used - self._low_mark(capacity))
        if target > 0:
            freed = self._evict_step(now, self.config.eviction_step, target, segment)
            if freed and target > freed:
                self._disk_targets[segment.index] = target - freed

    def _low_mark(self, capacity: int) -> float:
        """The usage eviction brings a tier down to, and never below."""
        return max(self.config.high_watermark - self.config.evict_fraction, 0.0) * capacity

    def _evict_step(self, now: float, count: int, target: int, disk: Segment | None) -> int:
        """Evict up to ``count`` objects from DRAM (``disk`` None) or from the disk segment
        ``disk`` (:func:`eviction.candidates`), stopping once ``target`` bytes of that tier's
        capacity are freed: a round ends within one object of its target. Returns the bytes
        of capacity freed."""
        picked = eviction.candidates(
            self.objects, self.segments, self.tenants, self._rng, now, count, disk
        )
        freed = 0
        for slot in picked:
            if freed >= target:
                break
            if disk is None:
                freed += self._evict_from_dram(slot, now)
            else:
                freed += disk.allocator.length(self.objects.size[slot])
                self._free(slot, now, RemovalReason.EVICTED)
                self.evictions += 1
                self.counters[Tier.DISK].evictions += 1
        self.evicted_bytes += freed
        return freed

    def _evict_from_dram(self, slot: int, now: float) -> int:
        """Take one object out of DRAM: drop its DRAM replicas if it has a disk one, else
        demote it to its server's disk if it can, else drop it. Returns the DRAM capacity
        freed (a demotion's source counts as freed: its space is in transit)."""
        objects = self.objects
        segments = self.segments.all
        size = objects.size[slot]
        live = self._live(slot)
        dram = [r for r in live if segments[r.segment].tier is Tier.DRAM]
        if not dram:
            return 0  # its DRAM replicas are gone already: the cleanup drops them
        freed = sum(segments[r.segment].allocator.length(size) for r in dram)
        self.counters[Tier.DRAM].evictions += 1
        if len(dram) < len(live):
            self.mover.release_replicas(slot, dram)
        elif not self.mover.demote(slot, dram):
            self._free(slot, now, RemovalReason.EVICTED)
            self.evictions += 1
        return freed

    # ------------------------------------------------------------------------------ helpers

    def _replicas_of(self, key: str) -> list[Replica]:
        slot = self.objects.index.get(key)
        return [] if slot < 0 else self.objects.replicas(slot)

    def _live(self, slot: int) -> list[Replica]:
        segments = self.segments.all
        return [
            replica for replica in self.objects.replicas(slot) if segments[replica.segment].alive
        ]

    def _readable(self, slot: int) -> bool:
        if self.segments.alive[self.objects.segment[slot]]:
            return True
        return bool(self._live(slot))

    def _locations(self, placed: list[Replica]) -> list[Location]:
        segments = self.segments.all
        return [
            Location(segments[i].spec.engine_segment, segments[i].spec.region, offset)
            for i, offset in placed
        ]

    def _log_removal(self, slot: int, reason: RemovalReason) -> None:
        key = self.objects.index.key(slot)
        if key is not None:
            self.removals.record(key, reason)

    def _discard(self, slot: int, now: float) -> None:
        """Drop a pending put; its space waits out the quarantine (the writer may be late)."""
        release = now + self.config.quarantine
        size = self.objects.size[slot]
        for segment, offset in self.objects.replicas(slot):
            self.segments.release(segment, offset, size, committed=False, until=release)
        self.objects.drop(slot)

    def _free(self, slot: int, now: float, reason: RemovalReason | None) -> None:
        """Drop an object; space under a read lease is reused only after the lease. A
        complete one goes into the removal log with ``reason`` (None: it is not gone, a
        recovered copy replaces it)."""
        objects = self.objects
        if objects.state[slot] == State.PENDING:
            self._discard(slot, now)
            return
        if reason is not None:
            self._log_removal(slot, reason)
        if reason is RemovalReason.EVICTED and objects.tenant[slot]:
            self.tenant_evictions[objects.tenant[slot]] += 1
        self.bytes_stored -= objects.size[slot]
        for replica in objects.replicas(slot):
            self.mover.release(slot, replica)
        objects.drop(slot)

    # ------------------------------------------------------------------------- tier reports

    def tier_report(self, server: str, report: TierReport, now: float) -> None:
        """Outcomes a server reports for one of its mounts: moves into it done or failed,
        objects of it lost. Idempotent: an outcome of no known move, or a loss of no known
        replica, is ignored (as is a report of a mount not ``server``'s)."""
        segment = self.segments.by_mount.get(report.mount_id)
        if segment is None or segment.server != server:
            return
        for moved in report.done:
            self.mover.done(segment, moved)
        for moved in report.failed:
            slot = self.mover.failed(segment, moved)
            if slot is not None:
                self._free(slot, now, RemovalReason.EVICTED)
                self.evictions += 1
        for moved in report.lost:
            self._replica_lost(segment, moved, now)

    def _replica_lost(self, segment: Segment, moved: Moved, now: float) -> None:
        """A server cannot serve a replica any more (checksum mismatch, read error)."""
        objects = self.objects
        slot = objects.index.get(moved.key)
        lost = Replica(segment.index, moved.offset)
        if slot < 0 or objects.state[slot] != State.COMPLETE:
            return
        replicas = objects.replicas(slot)
        if lost not in replicas:
            return
        self.counters[segment.tier].lost += 1
        rest = [r for r in replicas if r != lost]
        if any(self.segments.alive[r.segment] for r in rest):
            self.mover.release_replicas(slot, [lost])
        else:
            self._free(slot, now, RemovalReason.LOST)
