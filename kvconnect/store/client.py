"""StoreClient: the embedded client of the store, in the inference engine's process.

Metadata goes to the master (one RPC per run of up to ``MASTER_RUN`` keys of a batch); bytes
move straight between the caller's registered memory and store-server memory through the
transfer engine — over shared memory on the same host, TCP otherwise. Threads: every method
may be called from any thread.

The contract (docs/store.md, "Client API"):

- Invalid *arguments* raise InvalidRequest before anything is sent: lists of different
  lengths, offsets or sizes that are not integers or fall outside their region, a region not
  registered with this client, a part outside its object, a key's spans empty (or a span of
  0 bytes) or more than ``MAX_SPANS`` spans in a batch.
- Bad *data* is a per-key code, never an exception: a key that is not a non-empty string of
  at most ``MAX_KEY_BYTES`` bytes of UTF-8 without NUL (a lone surrogate cannot be encoded) is
  ``Code.INVALID`` and never leaves the client; so is a size of 0. The other keys of the batch
  go through. Single-key calls agree: ``put``/``remove`` return INVALID, ``get`` None and
  ``exists`` False.
- Store trouble is a per-key code too: an unreachable master or an open circuit breaker gives
  ``Code.UNAVAILABLE`` for every key; a request the master refuses gives every key the
  master's code (e.g. INVALID for a batch over ``MAX_BATCH`` keys). ``batch_exists``/``exists``
  and ``stats`` raise StoreError subclasses instead (there is no per-key code to carry it).
- ``BatchResult.sizes`` are the bytes the call moved per key: 0 for every key it did not store
  or read (EXISTS included: nothing was written).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvconnect.errors import (
    CircuitOpen,
    InvalidRequest,
    KVConnectError,
    MasterUnavailable,
    StoreError,
)
from kvconnect.lifecycle import Lifecycle
from kvconnect.store import batching as b
from kvconnect.store import messages as m
from kvconnect.store.batching import BatchResult, Regions, Span
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.federation import Federation, PeerStatus
from kvconnect.store.messages import Code, check_key
from kvconnect.store.resilience import CircuitBreaker, NegativeCache
from kvconnect.store.rpc import RpcClient
from kvconnect.transfer import TransferConfig, TransferOp, TransferRequest, TransferStatus
from kvconnect.transfer.batch import TransferBatch
from kvconnect.transfer.engine import TransferEngine
from kvconnect.transfer.memory import MemoryKind, MemoryRegion

__all__ = ["BatchResult", "Regions", "Span", "StoreClient"]

_RETRY = (Code.FAILED, Code.TIMEOUT)  # settled failures: another replica may serve the key
_CANCEL_POLL = 0.005  # seconds between two questions to a read's cancel hook

MASTER_RUN = 4096
"""Most keys of a batch in one master call: the master answers on one thread, and a call of
``MAX_BATCH`` keys held it about a second on a 2-core machine (longer than ``rpc_timeout``,
so a legal batch failed and left its puts pending) while every other client waited."""

Cancel = Callable[[], bool]
"""A read's cancel hook: called (from the reading thread) while its transfers run; True stops
the read."""


_COALESCE_BYTES = 1 << 20
"""Adjacent ranges are merged into one request up to this size: a batch the master placed in
one run (``local_first``) from one contiguous buffer then costs the transfer engine one request
instead of one per key, while a request stays small enough that a deadline still finds most
of a large batch's keys either done or not started. Ranges in a FILE region (a disk tier) never
merge: its source serves one object per read, verified."""


@dataclass(slots=True)
class _Range:
    """One request of a batch being built (see :class:`_Batch`); ``keys``: whose bytes it
    moves (one, or several whose ranges were adjacent on both sides); ``merges``: whether
    adjacent ranges may join it (its remote region is memory)."""

    local: MemoryRegion
    local_offset: int
    segment: str
    region: int
    remote_offset: int
    length: int
    keys: list[int]
    merges: bool


@dataclass(frozen=True, slots=True)
class _Batch:
    """Requests to submit as one transfer batch; ``memory(segment, region)``: whether a remote
    region is memory (ranges in it may merge)."""

    deadline: float
    memory: Callable[[str, int], bool]
    ranges: list[_Range] = field(default_factory=list)
    kinds: dict[tuple[str, int], bool] = field(default_factory=dict)
    """``memory``'s answers so far (asked once per remote region, not once per key)."""

    def add(
        self, key: int, spans: Sequence[Span], loc: m.Location, within: int, length: int
    ) -> None:
        """Key ``key``'s transfers between ``spans`` (in order) and ``length`` bytes of the
        replica at ``loc`` from object offset ``within`` (the spans' first ``length`` bytes),
        each merged into the previous request when it continues that one on both sides."""
        ranges = self.ranges
        at = loc.offset + within
        for span in spans:
            if length <= 0:
                break
            size = span.size if span.size < length else length
            last = ranges[-1] if ranges else None
            if (
                last is not None
                and last.remote_offset + last.length == at
                and last.local_offset + last.length == span.offset
                and last.local is span.region
                and last.region == loc.region
                and last.segment == loc.segment
                and last.merges
                and last.length + size <= _COALESCE_BYTES
            ):
                last.length += size
                if last.keys[-1] != key:
                    last.keys.append(key)
            else:
                merges = self._memory(loc)
                ranges.append(
                    _Range(
                        span.region, span.offset, loc.segment, loc.region, at, size, [key], merges
                    )
                )
            at, length = at + size, length - size

    def _memory(self, loc: m.Location) -> bool:
        where = (loc.segment, loc.region)
        memory = self.kinds.get(where)
        if memory is None:
            memory = self.kinds[where] = self.memory(loc.segment, loc.region)
        return memory

    def requests(self) -> list[TransferRequest]:
        return [
            TransferRequest(r.local, r.local_offset, r.segment, r.region, r.remote_offset, r.length)
            for r in self.ranges
        ]


class _Refused(StoreError):
    """The master is up and answered this request with an error code."""

    def __init__(self, request: m.Request, reply: m.Error) -> None:
        super().__init__(
            f"master refused {type(request).__name__}: {reply.code.name}: {reply.message}"
        )
        self.code = reply.code


class StoreClient(Lifecycle):
    """Put, get, exists and remove objects of the kvconnect store."""

    def __init__(
        self,
        config: StoreClientConfig | None = None,
        transfer: TransferConfig | None = None,
        *,
        engine: TransferEngine | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``engine``: share an engine the caller owns (then ``close`` leaves it running)."""
        self.config = config = config or StoreClientConfig()
        self._own_engine = engine is None
        self.engine = engine or TransferEngine(transfer or TransferConfig())
        self.client_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._rpc = RpcClient(
            config.master,
            config.rpc_timeout,
            token=self.engine.config.token,
            poll_window=config.poll_window,
        )
        self._breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown)
        self._negative = NegativeCache(config.negative_ttl, config.negative_entries)
        self._clock = clock
        self._host_id = ""
        self._federation: Federation | None = None
        if config.peers:
            self._federation = Federation(
                config,
                self.engine.config,
                make_client=lambda peer, engine: StoreClient(peer, engine, clock=clock),
                home_owns=self.engine.owns,
                put_home=lambda key, value: self.put(key, value, peers=False),
                get_home=lambda key: self.get(key, peers=False),
                report_home=self._report,
                client_id=self.client_id,
                clock=clock,
            )

    # ---------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the transfer engine (if owned) and the peers' (connected to in the
        background). Does not contact the home master. Idempotent."""
        if self._own_engine:
            self.engine.start()
        self._host_id = self.engine.segment.host_id
        if self._federation is not None:
            self._federation.start()

    def close(self) -> None:
        """Close the RPC sockets, the peers' clients and the engine (if owned). Idempotent."""
        if self._federation is not None:
            self._federation.close()
        self._rpc.close()
        if self._own_engine:
            self.engine.close()

    def connect(self, timeout: float | None = None) -> None:
        """Open a connection to the master ahead of the next call (within ``timeout``, by
        default ``rpc_timeout``), so that call's timeout is not spent on the handshake.
        Raises like any call (MasterUnavailable, CircuitOpen); the breaker counts the
        outcome."""
        self._admit(self._clock())
        try:
            self._rpc.connect(timeout)
        except MasterUnavailable:
            self._breaker.failure(self._clock())
            raise
        self._breaker.success()

    @property
    def breaker(self) -> CircuitBreaker:
        """The client's circuit breaker (its state tells whether the store is considered up)."""
        return self._breaker

    def peers(self) -> list[PeerStatus]:
        """The peer clusters (federation), in the configured order: breaker and counters."""
        return self._federation.status() if self._federation is not None else []

    def register(self, buffer: object) -> MemoryRegion:
        """Register memory for zero-copy ``batch_put_from``/``batch_get_into`` (host or GPU);
        private to this client: store servers never address it."""
        return self.engine.register(buffer, private=True)

    # --------------------------------------------------------------------------------- keys

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored (False for an invalid key). Raises StoreError
        subclasses (MasterUnavailable, CircuitOpen, a refusal by the master)."""
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether it is stored (invalid keys, and keys that failed to read recently,
        count as absent) at home or, for keys home lacks, in a peer cluster that is up.
        Raises like :meth:`exists` (for home's failures only: a peer's never raise)."""
        keys = b.plain_keys(keys)
        picked = b.valid_keys(keys)
        found = [False] * len(keys)
        if not picked:
            return found
        for run in b.runs(picked, MASTER_RUN):
            asked = b.take(keys, run)
            reply = self._call(m.Exists(asked))
            if not isinstance(reply, m.ExistsReply) or len(reply.found) != len(asked):
                raise StoreError(f"unexpected reply to exists: {reply!r}")
            failing = self._negative.failing(asked, self._clock())
            for i, there, bad in zip(run, reply.found, failing, strict=True):
                found[i] = there and not bad
        if self._federation is not None:
            missing = [i for i in picked if not found[i]]
            for i in self._federation.exists(keys, missing) if missing else ():
                found[i] = True
        return found

    def remove(self, key: str, *, force: bool = False) -> Code:
        """Remove one object; BUSY while it is being read or written (unless ``force``)."""
        return self.batch_remove([key], force=force)[0]

    def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[Code]:
        """Remove objects; per-key codes (INVALID for invalid keys)."""
        keys = b.plain_keys(keys)
        picked = b.valid_keys(keys)
        codes = [Code.INVALID] * len(keys)
        if not picked:
            return codes
        for run in b.runs(picked, MASTER_RUN):
            try:
                reply = self._call(m.Remove(b.take(keys, run), force))
            except StoreError as exc:
                answers = [_failure_code(exc)] * len(run)
            else:
                answers = _codes(reply, len(run))
            for i, code in zip(run, answers, strict=True):
                codes[i] = code
        return codes

    def stats(self) -> m.StatsReply:
        """The cluster as the master sees it. Raises StoreError subclasses."""
        reply = self._call(m.Stats())
        if not isinstance(reply, m.StatsReply):
            raise StoreError(f"unexpected reply to stats: {reply!r}")
        return reply

    def _report(self, report: m.PeerReport) -> None:
        """Tell the home master how this client uses its peers (``kvconnect status``)."""
        reply = self._call(report)
        if not isinstance(reply, m.CodesReply):
            raise StoreError(f"unexpected reply to a peer report: {reply!r}")

    def removals(self, prefix: str, since: int, limit: int = 1024) -> m.RemovalsReply:
        """Objects under ``prefix`` removed, evicted or lost after entry ``since`` of the
        master's removal log (see :class:`m.RemovalsReply`). Raises StoreError subclasses."""
        reply = self._call(m.Removals(prefix, since, limit))
        if not isinstance(reply, m.RemovalsReply):
            raise StoreError(f"unexpected reply to removals: {reply!r}")
        return reply

    # ---------------------------------------------------------------------------------- put

    def put(
        self,
        key: str,
        value: bytes | bytearray | memoryview,
        *,
        timeout: float | None = None,
        peers: bool = True,
    ) -> Code:
        """Store ``value`` under ``key`` (a copy-free registration of ``value`` for the call).
        An invalid key or an empty value is INVALID. While the result is UNSETTLED a transport
        thread may still read ``value``: the registration (which keeps it alive) ends once it
        lets go; the caller must not modify a mutable ``value`` before then. ``peers``: as in
        :meth:`batch_put_from`."""
        if not check_key(key) or not len(value):
            return Code.INVALID

        def put_into(region: MemoryRegion) -> BatchResult:
            return self.batch_put_from(
                [key], region, [0], [region.length], timeout=timeout, peers=peers
            )

        return self._with_region(value, put_into).codes[0]

    def batch_put_from(
        self,
        keys: Sequence[str],
        region: Regions,
        offsets: Sequence[int],
        sizes: Sequence[int],
        *,
        timeout: float | None = None,
        peers: bool = True,
    ) -> BatchResult:
        """Store ``region[offsets[i] : offsets[i] + sizes[i]]`` under ``keys[i]`` (``region``:
        one registered region, or one per key). Copied to the ``copy_writes`` peers unless
        ``peers`` is False (federation).

        Keys already stored are skipped (EXISTS). A key that cannot be written in time is
        revoked at the master (its space is quarantined) and reported TIMEOUT or FAILED; one
        whose write could not be stopped is UNSETTLED: neither completed nor revoked, the
        master discards it at its ``put_timeout`` and quarantines its space.
        """
        keys = b.plain_keys(keys)
        ranges = b.check_ranges(keys, region, offsets, sizes, self.engine.owns)
        return self._put(keys, ranges, None, timeout, peers=peers)

    def batch_put_part_from(
        self,
        keys: Sequence[str],
        region: Regions,
        offsets: Sequence[int],
        sizes: Sequence[int],
        *,
        part: int,
        parts: int,
        object_sizes: Sequence[int],
        object_offsets: Sequence[int],
        timeout: float | None = None,
    ) -> BatchResult:
        """Write part ``part`` of ``parts`` of each object (e.g. one TP rank's shard).

        Each object has ``object_sizes[i]`` bytes; this writer stores its ``sizes[i]`` bytes at
        ``object_offsets[i]`` within it. The object becomes readable once all parts are in.
        """
        keys = b.plain_keys(keys)
        ranges = b.check_ranges(keys, region, offsets, sizes, self.engine.owns)
        info = _part(ranges.sizes, part, parts, object_sizes, object_offsets)
        return self._put(keys, ranges, info, timeout)

    def batch_put_gathered(
        self,
        keys: Sequence[str],
        spans: Sequence[Sequence[Span]],
        *,
        part: int = 0,
        parts: int = 1,
        object_sizes: Sequence[int] | None = None,
        object_offsets: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> BatchResult:
        """Like :meth:`batch_put_part_from`, with each key's bytes gathered from several
        ranges: ``spans[i]``, in order, are the bytes this writer stores at
        ``object_offsets[i]`` of object ``keys[i]`` (e.g. every layer's K and V of a block).
        Without ``object_sizes`` each object is exactly its spans (one part at offset 0).
        ``BatchResult.sizes`` are the bytes of the spans written per key."""
        keys = b.plain_keys(keys)
        ranges = b.check_spans(keys, spans, self.engine.owns)
        totals = ranges.sizes if object_sizes is None else object_sizes
        within = [0] * len(keys) if object_offsets is None else object_offsets
        info = _part(ranges.sizes, part, parts, totals, within)
        return self._put(keys, ranges, info, timeout)

    def _put(
        self,
        keys: list[str],
        ranges: b.Ranges,
        part: b.Part | None,
        timeout: float | None,
        *,
        peers: bool = True,
    ) -> BatchResult:
        deadline = self._clock() + (self.config.io_timeout if timeout is None else timeout)
        picked = b.valid_keys(keys)
        if len(picked) == len(keys) <= MASTER_RUN:
            result = self._put_valid(keys, ranges, part, deadline)
        else:
            results = [
                self._put_valid(
                    b.take(keys, run), ranges.take(run), part.take(run) if part else None, deadline
                )
                for run in b.runs(picked, MASTER_RUN)
            ]
            result = b.spread(b.joined(results), picked, len(keys))
        if peers and self._federation is not None:
            self._federation.written(
                [k for k, code in zip(keys, result.codes, strict=True) if code is Code.OK]
            )
        return result

    def _put_valid(
        self, keys: list[str], ranges: b.Ranges, part: b.Part | None, deadline: float
    ) -> BatchResult:
        """Put valid keys (``ranges`` checked)."""
        if not keys:
            return b.all_codes(Code.OK, 0)
        totals = part.object_sizes if part else ranges.sizes
        items = [
            m.PutItem(key, total, part.count if part else 1)
            for key, total in zip(keys, totals, strict=True)
        ]
        try:
            reply = self._call(
                m.PutStart(self.client_id, items, self.config.replicas, self._host_id),
                deadline=deadline,
            )
        except StoreError as exc:
            return b.all_codes(_failure_code(exc), len(keys))
        if not isinstance(reply, m.PutStartReply) or len(reply.results) != len(keys):
            return b.all_codes(Code.INTERNAL, len(keys))
        codes = [p.code for p in reply.results]
        writes = _writes(reply, ranges, part, _Batch(deadline, self._memory))
        outcome, unsettled = self._transfer(TransferOp.WRITE, [writes], len(keys), None)
        started = [i for i in range(len(keys)) if codes[i] is Code.OK]
        for i in started:
            codes[i] = outcome[i]
        self._judge([codes[i] for i in started])
        self._finish_puts(keys, [p.put for p in reply.results], started, part, codes)
        self._negative.discard([keys[i] for i in started if codes[i] is Code.OK])
        moved = [
            size if code is Code.OK else 0 for code, size in zip(codes, ranges.sizes, strict=True)
        ]
        return BatchResult(tuple(codes), tuple(moved), tuple(unsettled))

    def _finish_puts(
        self,
        keys: list[str],
        puts: list[int],
        started: list[int],
        part: b.Part | None,
        codes: list[Code],
    ) -> None:
        """End the puts whose bytes are in (their codes become the master's verdict), revoke
        those that failed. ``started``: indices into ``keys`` of the puts the master placed.

        An UNSETTLED put is left pending: a write may still land in its space, and the master
        only reuses that after discarding the put at ``put_timeout`` plus ``quarantine``.
        """
        written = [i for i in started if codes[i] is Code.OK]
        failed = [i for i in started if codes[i] not in (Code.OK, Code.UNSETTLED)]
        if written:
            index = part.index if part else 0
            end = m.PutEnd(
                self.client_id,
                [keys[i] for i in written],
                [index] * len(written),
                [puts[i] for i in written],
            )
            try:
                ends = _codes(self._call(end), len(written))
            except StoreError as exc:
                ends = [_failure_code(exc)] * len(written)
            for i, code in zip(written, ends, strict=True):
                if code is not Code.OK:
                    codes[i] = Code.FAILED if code is Code.DISCARDED else code
        if failed:
            # If the master is unreachable, it discards the pending put at its timeout anyway.
            revoke = m.PutRevoke(
                self.client_id, [keys[i] for i in failed], [puts[i] for i in failed]
            )
            with contextlib.suppress(StoreError):
                self._call(revoke)

    # ---------------------------------------------------------------------------------- get

    def get(
        self, key: str, *, timeout: float | None = None, peers: bool = True
    ) -> bytearray | None:
        """The value of ``key`` (read straight into the returned buffer), or None when it is
        not stored, cannot be read in time, or ``key`` is invalid; from the home cluster
        only unless ``peers`` (federation)."""
        if not check_key(key):
            return None
        (key,) = b.plain_keys([key])
        start = self._clock()
        deadline = start + (self.config.io_timeout if timeout is None else timeout)
        reply = self._lookup([key], deadline)
        if isinstance(reply, Code) or reply.results[0].code is not Code.OK:
            home_lacks = not isinstance(reply, Code) and reply.results[0].code is Code.NOT_FOUND
            if home_lacks and peers and self._federation is not None:
                return self._federation.get(key, deadline)
            return None
        found = reply
        buffer = bytearray(found.results[0].size)

        def read_into(region: MemoryRegion) -> BatchResult:
            ranges = b.Ranges([(b.Span(region, 0, len(buffer)),)], [len(buffer)])
            return self._read([key], ranges, found, start, deadline, None)

        result = self._with_region(buffer, read_into)
        if result.codes[0] is not Code.OK:
            return None
        if peers and self._federation is not None:
            self._federation.home_hits(1)
        return buffer

    def batch_get_into(
        self,
        keys: Sequence[str],
        region: Regions,
        offsets: Sequence[int],
        sizes: Sequence[int],
        *,
        timeout: float | None = None,
        cancel: Cancel | None = None,
    ) -> BatchResult:
        """Read ``keys[i]`` into ``region`` at ``offsets[i]`` (at most ``sizes[i]`` bytes).

        Everything — the master lookup and the transfers — ends by ``timeout`` (default
        ``io_timeout``): keys not in by then are TIMEOUT and nothing more lands in their
        buffers (UNSETTLED keys excepted, see :class:`BatchResult`), so a caller can use
        ``result.leading()`` keys and recompute the rest. A key whose replica fails is read
        from its next replica within the same deadline (see :meth:`_read`).

        ``cancel`` ends the read early: asked every few milliseconds while transfers run (not
        during the master lookup, which ``rpc_timeout`` bounds), and once it answers True the
        transfers still running are canceled — keys not in are CANCELED, with the same
        guarantee as at the deadline (nothing more lands in their buffers, UNSETTLED keys
        excepted). A canceled key is not a store failure: it is neither reported absent
        later (negative cache) nor counted by the circuit breaker.
        """
        keys = b.plain_keys(keys)
        ranges = b.check_ranges(keys, region, offsets, sizes, self.engine.owns)
        return self._get(keys, ranges, timeout, cancel)

    def batch_get_scattered(
        self,
        keys: Sequence[str],
        spans: Sequence[Sequence[Span]],
        *,
        object_offsets: Sequence[int] | None = None,
        timeout: float | None = None,
        cancel: Cancel | None = None,
    ) -> BatchResult:
        """Read bytes of ``keys[i]`` from ``object_offsets[i]`` (default 0) on into the ranges
        ``spans[i]``, in order: exactly their total size, so a reader can take its own part
        of a multi-part object. A key whose object ends before that range is INVALID (nothing
        read). Deadline, cancel, replicas and UNSETTLED as for :meth:`batch_get_into`;
        ``BatchResult.sizes`` are the bytes read per key."""
        keys = b.plain_keys(keys)
        within = [0] * len(keys) if object_offsets is None else object_offsets
        ranges = b.check_spans(keys, spans, self.engine.owns, within)
        return self._get(keys, ranges, timeout, cancel)

    def _get(
        self, keys: list[str], ranges: b.Ranges, timeout: float | None, cancel: Cancel | None
    ) -> BatchResult:
        start = self._clock()
        deadline = start + (self.config.io_timeout if timeout is None else timeout)
        picked = b.valid_keys(keys)
        if len(picked) == len(keys) <= MASTER_RUN:
            return self._get_valid(keys, ranges, start, deadline, cancel)
        results = [
            self._get_valid(b.take(keys, run), ranges.take(run), start, deadline, cancel)
            for run in b.runs(picked, MASTER_RUN)
        ]
        return b.spread(b.joined(results), picked, len(keys))

    def _get_valid(
        self,
        keys: list[str],
        ranges: b.Ranges,
        start: float,
        deadline: float,
        cancel: Cancel | None,
    ) -> BatchResult:
        if not keys:
            return b.all_codes(Code.OK, 0)
        reply = self._lookup(keys, deadline)
        if isinstance(reply, Code):
            return b.all_codes(reply, len(keys))
        result = self._read(keys, ranges, reply, start, deadline, cancel)
        if self._federation is not None:
            result = self._federation.read(keys, ranges, result, deadline, cancel)
        return result

    def _lookup(self, keys: list[str], deadline: float) -> m.ReplicasReply | Code:
        """Replicas of ``keys`` (with a lease), or the code of every key when the master
        cannot be asked or refuses."""
        try:
            reply = self._call(m.GetReplicas(keys, self._host_id), deadline=deadline)
        except StoreError as exc:
            return _failure_code(exc)
        if not isinstance(reply, m.ReplicasReply) or len(reply.results) != len(keys):
            return Code.INTERNAL
        return reply

    def _read(
        self,
        keys: list[str],
        ranges: b.Ranges,
        reply: m.ReplicasReply,
        start: float,
        deadline: float,
        cancel: Cancel | None,
    ) -> BatchResult:
        """Move the replicas of ``reply`` into ``ranges``; the lease started at ``start``.

        Round r reads replica r of every key still to read, as one batch per number of
        replicas left: a key with k replicas left gets 1/k of the time left, so a replica
        that hangs (a stopped server) leaves time for the next. Keys whose read failed or
        timed out (settled: their buffer is free again) go to the next round while they have
        replicas, the deadline has not passed and ``cancel`` has not fired.
        """
        results = reply.results
        codes = [
            r.code if r.code is not Code.OK else _fits(r.size, ranges, i)
            for i, r in enumerate(results)
        ]
        attempted = [i for i, code in enumerate(codes) if code is Code.OK]
        todo, replica, unsettled = attempted, 0, []
        while todo:
            batches = self._read_round(todo, replica, ranges, reply, deadline)
            outcome, late = self._transfer(TransferOp.READ, batches, len(keys), cancel)
            unsettled += late
            for i in todo:
                codes[i] = outcome[i]
            replica += 1
            retry = [i for i in todo if codes[i] in _RETRY and replica < len(results[i].locations)]
            stopped = self._clock() >= deadline or (cancel is not None and cancel())
            todo = [] if stopped else retry
        self._judge([codes[i] for i in attempted if codes[i] is not Code.CANCELED])
        if self._clock() > start + reply.lease_ms / 1000:  # the bytes may have been reused
            codes = [Code.STALE if code is Code.OK else code for code in codes]
        failed = [keys[i] for i in attempted if codes[i] not in (Code.OK, Code.CANCELED)]
        self._negative.add(failed, self._clock())
        read = [
            _length(r.size, ranges, i) if code is Code.OK else 0
            for i, (r, code) in enumerate(zip(results, codes, strict=True))
        ]
        return BatchResult(tuple(codes), tuple(read), tuple(unsettled))

    def _read_round(
        self,
        todo: list[int],
        replica: int,
        ranges: b.Ranges,
        reply: m.ReplicasReply,
        deadline: float,
    ) -> list[_Batch]:
        """The batches of one round of :meth:`_read`."""
        now = self._clock()
        by_left: dict[int, _Batch] = {}
        results, spans, within = reply.results, ranges.spans, ranges.within
        for i in todo:
            replicas = results[i]
            locations = replicas.locations
            left = len(locations) - replica
            batch = by_left.get(left)
            if batch is None:
                batch = by_left[left] = _Batch(now + (deadline - now) / left, self._memory)
            offset = within[i] if within is not None else 0
            length = _length(replicas.size, ranges, i)
            batch.add(i, spans[i], locations[replica], offset, length)
        return list(by_left.values())

    # ------------------------------------------------------------------------------ helpers

    def _with_region(
        self, buffer: bytes | bytearray | memoryview, use: Callable[[MemoryRegion], BatchResult]
    ) -> BatchResult:
        """Run ``use`` on ``buffer`` registered for the call; the registration (which keeps
        ``buffer`` alive) ends once no transfer touches it, which for an UNSETTLED key is
        later, on a transport thread."""
        region = self.engine.register(buffer, private=True)
        try:
            result = use(region)
        except BaseException:
            self.engine.unregister(region)
            raise
        result.on_settled(functools.partial(self.engine.unregister, region))
        return result

    def _call(self, request: m.Request, *, deadline: float | None = None) -> m.Reply:
        """One RPC to the master. Raises MasterUnavailable, CircuitOpen, or a StoreError
        carrying the code the master refused the request with."""
        now = self._clock()
        self._admit(now)
        timeout = self.config.rpc_timeout
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - now))
        try:
            reply = self._rpc.call(request, timeout)
        except MasterUnavailable:
            self._breaker.failure(self._clock())
            raise
        # Every outcome must reach the breaker: a probe that is never judged would keep it
        # half-open, refusing everything, for ever.
        if isinstance(reply, m.Error):
            if reply.code is Code.NOT_LEADER:  # no leader serves (yet): the store is down
                self._breaker.failure(self._clock())
                raise MasterUnavailable(f"no master leads: {reply.message}")
            self._breaker.success()  # the master is up; it refused this request
            raise _Refused(request, reply)
        self._breaker.success()
        return reply

    def _admit(self, now: float) -> None:
        """Raise CircuitOpen unless the breaker lets a call to the master through."""
        if not self._breaker.allow(now):
            raise CircuitOpen("the store failed repeatedly; failing fast during the cool-down")

    def _transfer(
        self, op: TransferOp, batches: list[_Batch], count: int, cancel: Cancel | None
    ) -> tuple[list[Code], list[TransferBatch]]:
        """Run the batches (all submitted before any is waited for); per key of ``count``:
        OK if all its requests completed, else TIMEOUT, FAILED, CANCELED (``cancel`` fired)
        or UNSETTLED (a transport still holds its memory: the batches holding such keys are
        returned too)."""
        outcome = [Code.OK] * count
        running: list[tuple[list[_Range], TransferBatch]] = []
        for batch in batches:
            if not batch.ranges:
                continue
            remaining = max(0.0, batch.deadline - self._clock())
            try:
                running.append(
                    (batch.ranges, self.engine.submit(op, batch.requests(), timeout=remaining))
                )
            except KVConnectError:
                for piece in batch.ranges:
                    for i in piece.keys:
                        outcome[i] = Code.FAILED
        unsettled = []
        for pieces, handle in running:
            statuses = _wait(handle, cancel)
            for piece, status in zip(pieces, statuses, strict=True):
                code = _STATUS_CODE[status]
                for i in piece.keys:
                    outcome[i] = _worst(outcome[i], code)
            if TransferStatus.PENDING in statuses:
                unsettled.append(handle)
        return outcome, unsettled

    def _memory(self, segment: str, region: int) -> bool:
        """Whether a replica's region is memory as far as the engine knows (a region not
        known yet counts as not)."""
        info = self.engine.peer_region(segment, region)
        return info is not None and info.kind != MemoryKind.FILE.value

    def _judge(self, codes: list[Code]) -> None:
        """The data path failed if no key of a call got through (its master call succeeded,
        so this is what the breaker must learn)."""
        if codes and Code.OK not in codes:
            self._breaker.failure(self._clock())


def _wait(handle: TransferBatch, cancel: Cancel | None) -> tuple[TransferStatus, ...]:
    """The settled statuses of ``handle`` (see :meth:`TransferBatch.wait`); with ``cancel``,
    asked while the batch runs, the batch is canceled once it answers True. Canceling aborts
    the transports' accesses (a socket shut), so the wait ends as soon as they let go; one
    that does not still holds its requests PENDING at the end of the wait (UNSETTLED)."""
    if cancel is not None:
        while not handle.done() and time.monotonic() < handle.deadline:
            if cancel():
                handle.cancel()
                break
            handle.wait(_CANCEL_POLL)
    return handle.wait()


def _writes(
    reply: m.PutStartReply, ranges: b.Ranges, part: b.Part | None, writes: _Batch
) -> _Batch:
    """``writes`` (empty) with the writes of the placed keys: each to every replica (replica by
    replica, so that the keys' copies on one segment can merge)."""
    placed = [(i, p.locations) for i, p in enumerate(reply.results) if p.code is Code.OK]
    for replica in range(max((len(where) for _i, where in placed), default=0)):
        for i, where in placed:
            if replica < len(where):
                within = part.object_offsets[i] if part else 0
                writes.add(i, ranges.spans[i], where[replica], within, ranges.sizes[i])
    return writes


def _fits(size: int, ranges: b.Ranges, i: int) -> Code:
    """Whether key ``i``'s read of an object of ``size`` bytes can go ahead: OK, TOO_SMALL (a
    whole read into less memory) or INVALID (a scattered read past the object's end)."""
    if ranges.within is None:
        return Code.TOO_SMALL if size > ranges.sizes[i] else Code.OK
    return Code.INVALID if ranges.within[i] + ranges.sizes[i] > size else Code.OK


def _length(size: int, ranges: b.Ranges, i: int) -> int:
    """The bytes key ``i``'s read moves from an object of ``size`` bytes."""
    return size if ranges.within is None else ranges.sizes[i]


def _part(
    sizes: Sequence[int],
    part: object,
    parts: object,
    object_sizes: Sequence[int],
    object_offsets: Sequence[int],
) -> b.Part:
    """One writer's part of each object, checked (InvalidRequest): ``sizes[i]`` bytes at
    ``object_offsets[i]`` of an object of ``object_sizes[i]`` bytes."""
    b.same_length(sizes, object_sizes=object_sizes, object_offsets=object_offsets)
    index, count = b.integer(part, "part"), b.integer(parts, "parts")
    if not 0 <= index < count:
        raise InvalidRequest(f"part {index} is not in 0..{count - 1}")
    info = b.Part(
        index,
        count,
        b.integers(object_sizes, "object_sizes"),
        b.integers(object_offsets, "object_offsets"),
    )
    for size, within, total in zip(sizes, info.object_offsets, info.object_sizes, strict=True):
        if within < 0 or within + size > total:
            raise InvalidRequest(f"part range [{within}, {within + size}) outside {total} bytes")
    return info


# What a request's status means for its key, and which outcome wins when a key has several
# requests (replicas): the one that constrains the caller most.
_STATUS_CODE = {
    TransferStatus.COMPLETED: Code.OK,
    TransferStatus.PENDING: Code.UNSETTLED,
    TransferStatus.TIMEOUT: Code.TIMEOUT,
    TransferStatus.FAILED: Code.FAILED,
    TransferStatus.CANCELED: Code.CANCELED,
}
_SEVERITY = {Code.OK: 0, Code.FAILED: 1, Code.TIMEOUT: 2, Code.CANCELED: 3, Code.UNSETTLED: 4}


def _worst(first: Code, second: Code) -> Code:
    return first if _SEVERITY[first] >= _SEVERITY[second] else second


def _failure_code(exc: StoreError) -> Code:
    """Every key's code when a call to the master failed as a whole."""
    return exc.code if isinstance(exc, _Refused) else Code.UNAVAILABLE


def _codes(reply: m.Reply, count: int) -> list[Code]:
    if not isinstance(reply, m.CodesReply) or len(reply.codes) != count:
        return [Code.INTERNAL] * count
    return list(reply.codes)
