"""Which objects eviction takes, oldest access first. Pure: reads the object table, changes
nothing (the state evicts what these return).

Candidates come from a random sample of the table (the sampled LRU of Redis): bounded work per
round whatever the key count. A complete object is a candidate when its primary replica is in
the tier being evicted, no read lease holds it and it is not moving.
"""

from __future__ import annotations

import numpy as np

from kvconnect.store.master.objects import ObjectTable, State
from kvconnect.store.master.segments import Segment, SegmentTable
from kvconnect.store.master.tenants import Tenants


def sample_size(count: int) -> int:
    """Slots sampled to find ``count`` candidates."""
    return max(256, count * 16)


def candidates(
    objects: ObjectTable,
    segments: SegmentTable,
    tenants: Tenants,
    rng: np.random.Generator,
    now: float,
    count: int,
    disk: Segment | None,
) -> list[int]:
    """Up to ``count`` slots to evict from DRAM (``disk`` None) or from the disk segment
    ``disk``, oldest access first among a random sample. Soft-pinned objects only when no
    other is eligible; with tenants, the objects of tenants over their share come first."""
    n = objects.capacity
    if n == 0:
        return []
    sample = rng.integers(0, n, size=min(n, sample_size(count)))
    with objects.columns() as c:
        where = c["segment"][sample]
        if disk is None:
            tiers = np.frombuffer(segments.disk, dtype=np.uint8)
            in_tier = tiers[where] == 0
            del tiers  # the view pins the bytearray: mounts append to it
        else:
            in_tier = where == disk.index
        ok = in_tier & (c["state"][sample] == State.COMPLETE) & (c["lease"][sample] <= now)
        eligible = sample[ok]
        unpinned = eligible[c["pin"][eligible] <= now]
        pool = unpinned if len(unpinned) else eligible
        if len(tenants):  # the tenants over their share first, each oldest first
            over = tenants.over_share(objects.tenant_memory)[c["tenant"][pool]]
            order = np.lexsort((c["access"][pool], ~over))
        else:
            order = np.argsort(c["access"][pool], kind="stable")
        oldest_first = pool[order].tolist()
        del sample, where, in_tier, ok, eligible, unpinned, pool
    moving = objects.moving
    return [slot for slot in dict.fromkeys(oldest_first) if slot not in moving][:count]


def tenant_candidates(
    objects: ObjectTable,
    segments: SegmentTable,
    rng: np.random.Generator,
    tenant: int,
    now: float,
    count: int,
    disk: bool,
) -> list[int]:
    """Up to ``count`` of ``tenant``'s complete objects whose primary replica is on disk
    (``disk``) or in memory that may go (no lease, no move), oldest access first: from a
    random sample, or the whole table when the tenant is too rare to be in one (or the
    table is no larger than a sample)."""
    n, size = objects.capacity, sample_size(count)
    sample = rng.integers(0, n, size=size) if n > size else np.arange(0)
    tiers = np.frombuffer(segments.disk, dtype=np.uint8)
    with objects.columns() as c:
        slots = sample[c["tenant"][sample] == tenant]
        if not len(slots):
            slots = np.flatnonzero(c["tenant"] == tenant)
        in_tier = tiers[c["segment"][slots]] == int(disk)
        ok = in_tier & (c["state"][slots] == State.COMPLETE) & (c["lease"][slots] <= now)
        pool = np.unique(slots[ok])
        oldest = pool[np.argsort(c["access"][pool], kind="stable")][:count].tolist()
        del sample, slots, in_tier, ok, pool
    del tiers  # the view pins the bytearray: mounts append to it
    moving = objects.moving
    return [slot for slot in oldest if slot not in moving]
