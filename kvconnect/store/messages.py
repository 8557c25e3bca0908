"""Every control-plane message of the store (msgspec Structs on msgpack) and its version.

Clients and store servers talk to the master with one request per message; every hot-path
request carries a *batch* of keys. Envelopes carry ``PROTOCOL_VERSION``; the master answers a
request of another version with ``Error(Code.VERSION)`` and never guesses.

Every Struct is ``gc=False``: messages hold only strings, numbers and lists of other messages,
so they cannot form reference cycles, and tracking the thousands of them a batch decodes made
the cyclic collector run after almost every request (a fifth to a third of the master's time
on a put of 128 keys, docs/benchmarks.md).
"""

from __future__ import annotations

import enum
from typing import Final

import msgspec

PROTOCOL_VERSION: Final = 4  # 3: tiers (disk segments, moves, tier reports); 4: peer reports
MAX_KEY_BYTES: Final = 1024
MAX_TENANT_BYTES: Final = 32
MAX_STORED_KEY_BYTES: Final = MAX_KEY_BYTES + MAX_TENANT_BYTES + 2
"""The longest key the master stores: a client's key under its tenant's prefix."""
MAX_BATCH: Final = 65536
MAX_PEERS: Final = 16
"""The most peer clusters a client's report names."""


class Code(enum.IntEnum):
    """Per-key and per-request outcomes."""

    OK = 0
    NOT_FOUND = 1
    EXISTS = 2  # complete object already stored: a put skips it
    BUSY = 3  # another put of this key is in progress, or the object is leased (remove)
    NO_SPACE = 4
    INVALID = 5  # bad key, size or parts
    DISCARDED = 6  # the pending put was given up (timeout, revoke, segment loss)
    VERSION = 7
    UNKNOWN_SEGMENT = 8
    INTERNAL = 9
    NOT_LEADER = 15  # a standby master: ask the leader
    # Outcomes only the client produces:
    TIMEOUT = 10  # the transfer missed its deadline
    FAILED = 11  # the transfer failed (peer died, refused)
    TOO_SMALL = 12  # the caller's buffer is smaller than the object
    UNAVAILABLE = 13  # the master did not answer, or the circuit breaker is open
    STALE = 14  # the read outlived its lease: the bytes cannot be trusted
    UNSETTLED = 16  # the transfer could not be stopped: its buffer may still be written
    CANCELED = 17  # the caller's cancel hook stopped the read before the key arrived
    DENIED = 18  # the caller's token does not allow this request (a tenant's store-server call)


class Tier(enum.IntEnum):
    """The storage tier of a segment: memory, or a file on a local disk under it."""

    DRAM = 0
    DISK = 1


class Location(msgspec.Struct, gc=False, array_like=True, frozen=True):
    """Where one replica lives: a transfer-engine segment, a region of it, an offset."""

    segment: str
    region: int
    offset: int


class PutItem(msgspec.Struct, gc=False, array_like=True, frozen=True):
    """One object to store: ``parts`` writers may each write a byte range of it."""

    key: str
    size: int
    parts: int = 1


class Placement(msgspec.Struct, gc=False, array_like=True, frozen=True):
    """Answer to one PutItem: where to write (code OK) or why not. ``put`` names this put in
    PutEnd/PutRevoke, so a late writer never completes or revokes another writer's put of the
    same key (after a timeout, or across a master failover)."""

    code: Code
    locations: list[Location]
    put: int = 0


class Replicas(msgspec.Struct, gc=False, array_like=True, frozen=True):
    """Answer to one key of GetReplicas."""

    code: Code
    size: int
    locations: list[Location]


class Change(msgspec.Struct, gc=False, array_like=True, frozen=True):
    """One change to what a segment holds: an object committed there (``key`` set) or the space
    of the object at ``offset`` released (``key`` empty). Also one held object in a report.

    ``source_region`` != 0 makes it a *move*: the server copies the object at
    (``source_region``, ``source_offset``) of its own transfer engine into (this mount,
    ``offset``) and reports the outcome in a :class:`TierReport`; the object is not held there
    until the move is done."""

    key: str
    offset: int
    size: int
    source_region: int = 0
    source_offset: int = 0


class Changes(msgspec.Struct, gc=False, array_like=True, frozen=True):
    """The master's journal of one mount from sequence number ``first`` on."""

    mount_id: str
    first: int
    changes: list[Change]


class SegmentSpec(msgspec.Struct, gc=False, frozen=True):
    """A block of store-server memory offered to the master."""

    name: str  # unique in the cluster and stable across remounts: the engine segment name
    engine_segment: str
    region: int
    size: int
    host_id: str
    tier: Tier = Tier.DRAM


class SegmentStats(msgspec.Struct, gc=False, frozen=True):
    """One mounted segment, as ``stats`` reports it."""

    name: str
    host_id: str
    server: str
    capacity: int
    used: int  # bytes of stored objects and pending puts
    objects: int
    backlog: int = 0  # journal changes its server has not acknowledged
    in_transit: int = 0  # bytes released but not allocatable yet (acknowledgement, lease)
    tier: Tier = Tier.DRAM


class TierStats(msgspec.Struct, gc=False, frozen=True):
    """One tier over its live segments, as ``stats`` reports it. Moves count in the tier they
    go into (demotions in DISK, promotions in DRAM)."""

    tier: Tier
    capacity: int
    used: int  # bytes of stored objects, pending puts and moves under way
    objects: int  # replicas held in the tier
    hits: int  # reads answered with a replica of this tier first
    demotions: int  # objects moved into this tier from the one above
    demotions_failed: int
    promotions: int  # objects copied into this tier from the one below
    evictions: int  # objects this tier's eviction took out of it (dropped or demoted)
    lost: int  # replicas of this tier lost (a report of unreadable bytes, a lost segment)


class TenantStats(msgspec.Struct, gc=False, frozen=True):
    """One tenant as ``stats`` reports it (a tenant sees only itself)."""

    name: str
    quota: int  # bytes in memory (0: none)
    disk_quota: int  # bytes on disk (0: none)
    share: int  # bytes of memory it is entitled to when the store is full
    used: int  # bytes of its objects and puts under way in memory (their primary replica)
    disk_used: int  # bytes of its objects on disk only
    objects: int
    evictions: int  # its objects dropped by eviction (its quota's or the store's)


# ---------------------------------------------------------------------------------- requests


class Exists(msgspec.Struct, gc=False, tag="exists"):
    keys: list[str]


class PutStart(msgspec.Struct, gc=False, tag="put_start"):
    client: str
    items: list[PutItem]
    replicas: int = 1
    host_id: str = ""  # the writer's host: ``local_first`` places there first
    pin: bool = False


class PutEnd(msgspec.Struct, gc=False, tag="put_end"):
    client: str
    keys: list[str]
    parts: list[int]
    puts: list[int]  # Placement.put of each key


class PutRevoke(msgspec.Struct, gc=False, tag="put_revoke"):
    client: str
    keys: list[str]
    puts: list[int]  # Placement.put of each key


class GetReplicas(msgspec.Struct, gc=False, tag="get_replicas"):
    keys: list[str]
    host_id: str = ""  # the reader's host: its replicas come first


class Remove(msgspec.Struct, gc=False, tag="remove"):
    keys: list[str]
    force: bool = False


class Mount(msgspec.Struct, gc=False, tag="mount"):
    """Offer a segment. ``held``: objects the segment already holds (after a master restart or
    failover), sorted by offset; ``more``: further ones follow in Report messages, and the
    master allocates nothing there until the last one."""

    server: str
    mount_id: str
    segment: SegmentSpec
    held: list[Change] = []
    more: bool = False


class Report(msgspec.Struct, gc=False, tag="report"):
    """More held objects of a mount (see Mount), continuing in offset order."""

    server: str
    mount_id: str
    held: list[Change]
    more: bool


class Unmount(msgspec.Struct, gc=False, tag="unmount"):
    server: str
    mount_ids: list[str]


class Moved(msgspec.Struct, gc=False, array_like=True, frozen=True):
    """One object of a TierReport: ``offset`` is in the mount the report names."""

    key: str
    offset: int


class TierReport(msgspec.Struct, gc=False, array_like=True, frozen=True):
    """Outcomes of one mount since the last report that got a reply. The master ignores any
    it knows no move or replica for (a resent report is harmless)."""

    mount_id: str
    done: list[Moved] = []  # moves into this mount completed (durable on disk, loaded in DRAM)
    failed: list[Moved] = []  # moves into this mount given up (queue full, I/O error, tier down)
    lost: list[Moved] = []  # objects of this mount that can no longer be served: drop them


class Heartbeat(msgspec.Struct, gc=False, tag="heartbeat"):
    """Liveness, and per mount how many journal changes the server has applied (an ack: the
    master reuses released space only once the server knows it no longer holds that object).
    ``reports``: outcomes of moves and unreadable objects (resent until a reply came)."""

    server: str
    mount_ids: list[str]
    applied: list[int]
    reports: list[TierReport] = []


class Stats(msgspec.Struct, gc=False, tag="stats"):
    pass


class PeerCounts(msgspec.Struct, gc=False, array_like=True, frozen=True):
    """What a client did with one peer cluster since it started (federation)."""

    asked: int = 0  # keys looked up there
    hits: int = 0  # keys read from there
    bytes_read: int = 0
    failures: int = 0  # calls to it that failed
    skipped: int = 0  # keys not asked while its breaker was open
    copied: int = 0  # keys copied between it and home (either way)


class PeerUse(msgspec.Struct, gc=False, array_like=True, frozen=True):
    """A client's use of one peer cluster."""

    peer: str
    master: str
    up: bool  # the client's breaker for the peer is closed (it asks the peer)
    counts: PeerCounts


class PeerReport(msgspec.Struct, gc=False, tag="peer_report"):
    """A federating client's periodic report of its peers to its home master, which keeps
    the latest of each client for ``kvconnect status`` (``MAX_PEERS`` peers at most)."""

    client: str
    home_hits: int  # keys this client read from home
    peers: list[PeerUse]


class Removals(msgspec.Struct, gc=False, tag="removals"):
    """Complete objects under ``prefix`` that stopped existing after sequence number ``since``
    of the master's removal log (see :mod:`kvconnect.store.master.removals`); at most
    ``limit`` of them (the master caps it)."""

    prefix: str
    since: int = 0
    limit: int = 1024


Request = (
    Exists
    | PutStart
    | PutEnd
    | PutRevoke
    | GetReplicas
    | Remove
    | Mount
    | Report
    | Unmount
    | Heartbeat
    | Stats
    | Removals
    | PeerReport
)

# ------------------------------------------------------------------------------------ replies


class ExistsReply(msgspec.Struct, gc=False, tag="exists"):
    found: list[bool]


class PutStartReply(msgspec.Struct, gc=False, tag="put_start"):
    results: list[Placement]


class CodesReply(msgspec.Struct, gc=False, tag="codes"):
    codes: list[Code]


class ReplicasReply(msgspec.Struct, gc=False, tag="replicas"):
    results: list[Replicas]
    lease_ms: int


class HeartbeatReply(msgspec.Struct, gc=False, tag="heartbeat"):
    unknown: list[str]  # mount ids the master does not have: mount them again
    changes: list[Changes]  # journal changes the server has not applied yet
    tenants: list[str] = []  # the tenants whose clients the server's transfer engine admits


class PeerSummary(msgspec.Struct, gc=False, frozen=True):
    """One peer cluster as the clients that reported it recently see it (their sums)."""

    peer: str
    master: str
    clients: int  # clients that use it
    down: int  # of them, those whose breaker for it is open
    reads: int  # keys those clients read from home and every peer: ``hits / reads`` is its share
    counts: PeerCounts  # summed over those clients


class StatsReply(msgspec.Struct, gc=False, tag="stats"):
    keys: int
    pending: int
    bytes_stored: int
    evictions: int
    evicted_bytes: int
    segments: list[SegmentStats]
    term: int = 0  # with HA: the leader's term (create revision of its etcd key); 0: standby
    refused: int = 0  # connections refused for want of the cluster token
    dropped: int = 0  # messages dropped unanswered (malformed, too deep, reply not sendable)
    connections: int = 0  # client connections open at the master
    tiers: list[TierStats] = []
    tenants: list[TenantStats] = []
    peers: list[PeerSummary] = []


class RemovalReason(enum.IntEnum):
    """Why an object stopped existing."""

    REMOVED = 0  # a client removed it
    EVICTED = 1  # the master evicted it to make room
    LOST = 2  # its last replica's segment went away


class Removal(msgspec.Struct, gc=False, array_like=True, frozen=True):
    """One entry of the master's removal log."""

    seq: int
    key: str
    reason: RemovalReason


class RemovalsReply(msgspec.Struct, gc=False, tag="removals"):
    """``removed``: the matching entries found; ``next``: the last sequence number examined
    (ask again with ``since=next``); ``first``: the oldest kept (entries before it are lost);
    ``epoch``: names the log (another epoch: the master restarted, start again from 0)."""

    epoch: int
    first: int
    next: int
    removed: list[Removal]


class Error(msgspec.Struct, gc=False, tag="error"):
    code: Code
    message: str


Reply = (
    ExistsReply
    | PutStartReply
    | CodesReply
    | ReplicasReply
    | HeartbeatReply
    | StatsReply
    | RemovalsReply
    | Error
)


class Envelope(msgspec.Struct, gc=False, array_like=True):
    """A request on the wire."""

    version: int
    request_id: int
    body: Request


class ReplyEnvelope(msgspec.Struct, gc=False, array_like=True):
    """A reply on the wire."""

    request_id: int
    body: Reply


class Head(msgspec.Struct, gc=False, array_like=True):
    """The leading fields of an Envelope, decodable whatever the version of the body."""

    version: int
    request_id: int


def check_key(key: object, limit: int = MAX_KEY_BYTES) -> bool:
    """Keys are non-empty strings of at most ``limit`` (MAX_KEY_BYTES) bytes of UTF-8, without
    NUL (C consumers of keys end them there). A string with a lone surrogate cannot be
    encoded."""
    if not isinstance(key, str) or not key or "\0" in key:
        return False
    if key.isascii():  # the common case, told without encoding: a byte per character
        return len(key) <= limit
    try:
        return len(key.encode()) <= limit
    except UnicodeEncodeError:
        return False
