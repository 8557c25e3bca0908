"""StoreClient: the embedded client of the store, in the inference engine's process.

Metadata goes to the master (one RPC per batch); bytes move straight between the caller's
registered memory and store-server memory through the transfer engine — over shared memory on
the same host, TCP otherwise. Threads: every method may be called from any thread.

Batch methods return a :class:`BatchResult` (a code per key) and never raise for store trouble:
an unreachable master or an open circuit breaker gives ``Code.UNAVAILABLE`` for every key.
``batch_exists`` and ``exists`` raise StoreError subclasses instead (there is no per-key code
to carry it). Invalid arguments raise InvalidRequest.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvconnect.config import StoreClientConfig, TransferConfig
from kvconnect.errors import (
    CircuitOpen,
    InvalidRequest,
    KVConnectError,
    MasterUnavailable,
    StoreError,
)
from kvconnect.lifecycle import Lifecycle
from kvconnect.store import messages as m
from kvconnect.store.messages import Code
from kvconnect.store.resilience import CircuitBreaker, NegativeCache
from kvconnect.store.rpc import RpcClient
from kvconnect.transfer.batch import TransferBatch
from kvconnect.transfer.engine import TransferEngine
from kvconnect.transfer.memory import MemoryRegion
from kvconnect.transfer.transport import TransferOp, TransferRequest, TransferStatus

_STORED = (Code.OK, Code.EXISTS)

Regions = MemoryRegion | Sequence[MemoryRegion]
"""One registered region for the whole batch, or one per key."""


@dataclass(frozen=True, slots=True)
class BatchResult:
    """Per-key outcome of a batch, and the object sizes read (0 where nothing was read).

    A key is UNSETTLED when its transfer could not be stopped by the deadline: a transport
    thread may still write (get) or read (put) its buffer range, so the caller must not reuse
    that range before :meth:`on_settled` runs its callback.
    """

    codes: tuple[Code, ...]
    sizes: tuple[int, ...]
    _batch: TransferBatch | None = field(default=None, repr=False, compare=False)

    def on_settled(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once no transfer of this batch touches its buffers any more: at
        once if none does (every key but UNSETTLED ones), else on a transport thread."""
        if self._batch is None:
            callback()
        else:
            self._batch.add_settled_callback(callback)

    def leading(self) -> int:
        """How many keys from the start completed: the prefix a caller can use as is."""
        for n, code in enumerate(self.codes):
            if code not in _STORED:
                return n
        return len(self.codes)

    def ok(self) -> list[bool]:
        """Per key: the object is now stored (put) or was read (get)."""
        return [code in _STORED for code in self.codes]


@dataclass(frozen=True, slots=True)
class _Part:
    index: int
    count: int
    object_sizes: Sequence[int]
    object_offsets: Sequence[int]


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
        self._rpc = RpcClient(config.master, config.rpc_timeout, token=self.engine.config.token)
        self._breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown)
        self._negative = NegativeCache(config.negative_ttl, config.negative_entries)
        self._clock = clock
        self._host_id = ""

    # ---------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the transfer engine (if owned). Does not contact the master."""
        if self._own_engine:
            self.engine.start()
        self._host_id = self.engine.segment.host_id

    def close(self) -> None:
        """Close the RPC sockets and the engine (if owned). Idempotent."""
        self._rpc.close()
        if self._own_engine:
            self.engine.close()

    @property
    def breaker(self) -> CircuitBreaker:
        """The client's circuit breaker (its state tells whether the store is considered up)."""
        return self._breaker

    def register(self, buffer: object) -> MemoryRegion:
        """Register memory for zero-copy ``batch_put_from``/``batch_get_into`` (host or GPU)."""
        return self.engine.register(buffer)

    # --------------------------------------------------------------------------------- keys

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored. Raises MasterUnavailable / CircuitOpen."""
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether it is stored (keys that failed to read recently count as absent)."""
        keys = list(keys)
        reply = self._call(m.Exists(keys))
        if not isinstance(reply, m.ExistsReply) or len(reply.found) != len(keys):
            raise StoreError(f"unexpected reply to exists: {reply!r}")
        failing = self._negative.failing(keys, self._clock())
        return [found and not bad for found, bad in zip(reply.found, failing, strict=True)]

    def remove(self, key: str, *, force: bool = False) -> Code:
        """Remove one object; BUSY while it is being read or written (unless ``force``)."""
        return self.batch_remove([key], force=force)[0]

    def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[Code]:
        """Remove objects; per-key codes."""
        keys = list(keys)
        try:
            reply = self._call(m.Remove(keys, force))
        except StoreError:
            return [Code.UNAVAILABLE] * len(keys)
        return _codes(reply, len(keys))

    def stats(self) -> m.StatsReply:
        """The cluster as the master sees it. Raises StoreError subclasses."""
        reply = self._call(m.Stats())
        if not isinstance(reply, m.StatsReply):
            raise StoreError(f"unexpected reply to stats: {reply!r}")
        return reply

    # ---------------------------------------------------------------------------------- put

    def put(
        self, key: str, value: bytes | bytearray | memoryview, *, timeout: float | None = None
    ) -> Code:
        """Store ``value`` under ``key`` (a copy-free registration of ``value`` for the call)."""
        if not len(value):
            return Code.INVALID
        region = self.engine.register(value)
        try:
            return self.batch_put_from([key], region, [0], [region.length], timeout=timeout).codes[
                0
            ]
        finally:
            self.engine.unregister(region)

    def batch_put_from(
        self,
        keys: Sequence[str],
        region: Regions,
        offsets: Sequence[int],
        sizes: Sequence[int],
        *,
        timeout: float | None = None,
    ) -> BatchResult:
        """Store ``region[offsets[i] : offsets[i] + sizes[i]]`` under ``keys[i]`` (``region``:
        one registered region, or one per key).

        Keys already stored are skipped (EXISTS). A key that cannot be written in time is
        revoked at the master (its space is freed) and reported TIMEOUT or FAILED.
        """
        return self._put(keys, region, offsets, sizes, None, timeout)

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
        _same_length(keys, object_sizes=object_sizes, object_offsets=object_offsets)
        info = _Part(part, parts, object_sizes, object_offsets)
        if not 0 <= part < parts:
            raise InvalidRequest(f"part {part} is not in 0..{parts - 1}")
        for size, within, total in zip(sizes, object_offsets, object_sizes, strict=True):
            if within < 0 or within + size > total:
                raise InvalidRequest(
                    f"part range [{within}, {within + size}) outside {total} bytes"
                )
        return self._put(keys, region, offsets, sizes, info, timeout)

    def _put(
        self,
        keys: Sequence[str],
        region: Regions,
        offsets: Sequence[int],
        sizes: Sequence[int],
        part: _Part | None,
        timeout: float | None,
    ) -> BatchResult:
        keys = list(keys)
        regions = self._check_ranges(keys, region, offsets, sizes)
        deadline = self._clock() + (self.config.io_timeout if timeout is None else timeout)
        totals = part.object_sizes if part else sizes
        items = [
            m.PutItem(key, total, part.count if part else 1)
            for key, total in zip(keys, totals, strict=True)
        ]
        try:
            reply = self._call(
                m.PutStart(self.client_id, items, self.config.replicas, self._host_id),
                deadline=deadline,
            )
        except StoreError:
            return _all(Code.UNAVAILABLE, len(keys))
        if not isinstance(reply, m.PutStartReply) or len(reply.results) != len(keys):
            return _all(Code.INTERNAL, len(keys))
        codes = [p.code for p in reply.results]
        requests: list[TransferRequest] = []
        owners: list[int] = []
        for i, placement in enumerate(reply.results):
            if placement.code is not Code.OK:
                continue
            within = part.object_offsets[i] if part else 0
            for loc in placement.locations:
                requests.append(
                    TransferRequest(
                        regions[i],
                        offsets[i],
                        loc.segment,
                        loc.region,
                        loc.offset + within,
                        sizes[i],
                    )
                )
                owners.append(i)
        outcome, batch = self._transfer(TransferOp.WRITE, requests, owners, len(keys), deadline)
        started = [i for i in range(len(keys)) if codes[i] is Code.OK]
        written = [i for i in started if outcome[i] is Code.OK]
        failed = [i for i in started if outcome[i] is not Code.OK]
        for i in started:
            codes[i] = outcome[i]
        self._finish_puts(keys, [p.put for p in reply.results], written, failed, part, codes)
        self._negative.discard([keys[i] for i in written])
        return BatchResult(tuple(codes), tuple(sizes), batch)

    def _finish_puts(
        self,
        keys: list[str],
        puts: list[int],
        written: list[int],
        failed: list[int],
        part: _Part | None,
        codes: list[Code],
    ) -> None:
        """End the puts whose bytes are in (their codes become the master's verdict), revoke
        the others. ``written``/``failed``: indices into ``keys``."""
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
            except StoreError:
                ends = [Code.UNAVAILABLE] * len(written)
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

    def get(self, key: str, *, timeout: float | None = None) -> bytearray | None:
        """The value of ``key`` (read straight into the returned buffer), or None when it is
        not stored or cannot be read in time."""
        start = self._clock()
        deadline = start + (self.config.io_timeout if timeout is None else timeout)
        reply = self._lookup([key], deadline)
        if reply is None or reply.results[0].code is not Code.OK:
            return None
        buffer = bytearray(reply.results[0].size)
        region = self.engine.register(buffer)
        try:
            result = self._read([key], [region], [0], [len(buffer)], reply, start, deadline)
        finally:
            self.engine.unregister(region)
        if result.codes[0] is not Code.OK:
            return None
        return buffer

    def batch_get_into(
        self,
        keys: Sequence[str],
        region: Regions,
        offsets: Sequence[int],
        sizes: Sequence[int],
        *,
        timeout: float | None = None,
    ) -> BatchResult:
        """Read ``keys[i]`` into ``region`` at ``offsets[i]`` (at most ``sizes[i]`` bytes).

        Everything — the master lookup and the transfers — ends by ``timeout`` (default
        ``io_timeout``): keys not in by then are TIMEOUT and nothing more lands in their
        buffers, so a caller can use ``result.leading()`` keys and recompute the rest.
        """
        keys = list(keys)
        regions = self._check_ranges(keys, region, offsets, sizes)
        start = self._clock()
        deadline = start + (self.config.io_timeout if timeout is None else timeout)
        reply = self._lookup(keys, deadline)
        if reply is None:
            return _all(Code.UNAVAILABLE, len(keys))
        return self._read(keys, regions, offsets, sizes, reply, start, deadline)

    def _lookup(self, keys: list[str], deadline: float) -> m.ReplicasReply | None:
        """Replicas of ``keys`` (with a lease), or None when the master cannot be asked."""
        try:
            reply = self._call(m.GetReplicas(keys, self._host_id), deadline=deadline)
        except StoreError:
            return None
        if not isinstance(reply, m.ReplicasReply) or len(reply.results) != len(keys):
            return None
        return reply

    def _read(
        self,
        keys: list[str],
        regions: list[MemoryRegion],
        offsets: Sequence[int],
        sizes: Sequence[int],
        reply: m.ReplicasReply,
        start: float,
        deadline: float,
    ) -> BatchResult:
        """Move the replicas of ``reply`` into ``regions``; the lease started at ``start``."""
        lease_end = start + reply.lease_ms / 1000
        codes = [r.code for r in reply.results]
        found = [r.size for r in reply.results]
        requests: list[TransferRequest] = []
        owners: list[int] = []
        for i, replicas in enumerate(reply.results):
            if replicas.code is not Code.OK:
                continue
            if replicas.size > sizes[i]:
                codes[i] = Code.TOO_SMALL
                continue
            loc = replicas.locations[0]
            requests.append(
                TransferRequest(
                    regions[i], offsets[i], loc.segment, loc.region, loc.offset, replicas.size
                )
            )
            owners.append(i)
        outcome, batch = self._transfer(TransferOp.READ, requests, owners, len(keys), deadline)
        stale = self._clock() > lease_end
        for i in set(owners):
            codes[i] = Code.STALE if stale and outcome[i] is Code.OK else outcome[i]
        bad = [keys[i] for i in set(owners) if codes[i] is not Code.OK]
        self._negative.add(bad, self._clock())
        read = [found[i] if codes[i] is Code.OK else 0 for i in range(len(keys))]
        return BatchResult(tuple(codes), tuple(read), batch)

    # ------------------------------------------------------------------------------ helpers

    def _check_ranges(
        self,
        keys: list[str],
        region: Regions,
        offsets: Sequence[int],
        sizes: Sequence[int],
    ) -> list[MemoryRegion]:
        """Refuse a batch that cannot work before asking the master for anything; returns
        each key's region."""
        _same_length(keys, offsets=offsets, sizes=sizes)
        regions = [region] * len(keys) if isinstance(region, MemoryRegion) else list(region)
        if len(regions) != len(keys):
            raise InvalidRequest(f"{len(regions)} regions for {len(keys)} keys")
        for one in set(regions):
            if not self.engine.owns(one):
                raise InvalidRequest(f"region {one.id} is not registered with this client's engine")
        for one, offset, size in zip(regions, offsets, sizes, strict=True):
            if offset < 0 or size < 0 or offset + size > one.length:
                raise InvalidRequest(
                    f"range [{offset}, {offset + size}) is outside the {one.length}-byte region"
                )
        return regions

    def _call(self, request: m.Request, *, deadline: float | None = None) -> m.Reply:
        now = self._clock()
        if not self._breaker.allow(now):
            raise CircuitOpen("the store failed repeatedly; failing fast during the cool-down")
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
            raise StoreError(
                f"master refused {type(request).__name__}: {reply.code.name}: {reply.message}"
            )
        self._breaker.success()
        return reply

    def _transfer(
        self,
        op: TransferOp,
        requests: list[TransferRequest],
        owners: list[int],
        count: int,
        deadline: float,
    ) -> tuple[list[Code], TransferBatch | None]:
        """Run the batch; per key: OK if all its requests completed, else TIMEOUT, FAILED or
        UNSETTLED (a transport still holds its memory: then the batch is returned too)."""
        outcome = [Code.OK] * count
        if not requests:
            return outcome, None
        remaining = max(0.0, deadline - self._clock())
        try:
            batch = self.engine.submit(op, requests, timeout=remaining)
        except KVConnectError:
            for i in owners:
                outcome[i] = Code.FAILED
            return outcome, None
        statuses = batch.wait()
        for i, status in zip(owners, statuses, strict=True):
            outcome[i] = _worst(outcome[i], _STATUS_CODE[status])
        if all(s is not TransferStatus.COMPLETED for s in statuses):
            self._breaker.failure(self._clock())  # the store's data path is failing
        unsettled = TransferStatus.PENDING in statuses
        return outcome, batch if unsettled else None


# What a request's status means for its key, and which outcome wins when a key has several
# requests (replicas): the one that constrains the caller most.
_STATUS_CODE = {
    TransferStatus.COMPLETED: Code.OK,
    TransferStatus.PENDING: Code.UNSETTLED,
    TransferStatus.TIMEOUT: Code.TIMEOUT,
    TransferStatus.FAILED: Code.FAILED,
    TransferStatus.CANCELED: Code.FAILED,
}
_SEVERITY = {Code.OK: 0, Code.FAILED: 1, Code.TIMEOUT: 2, Code.UNSETTLED: 3}


def _worst(first: Code, second: Code) -> Code:
    return first if _SEVERITY[first] >= _SEVERITY[second] else second


def _codes(reply: m.Reply, count: int) -> list[Code]:
    if not isinstance(reply, m.CodesReply) or len(reply.codes) != count:
        return [Code.INTERNAL] * count
    return list(reply.codes)


def _all(code: Code, count: int) -> BatchResult:
    return BatchResult((code,) * count, (0,) * count)


def _same_length(keys: Sequence[str], **others: Sequence[int]) -> None:
    for name, values in others.items():
        if len(values) != len(keys):
            raise InvalidRequest(f"{name} has {len(values)} entries for {len(keys)} keys")
