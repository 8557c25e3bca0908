"""Batches: per-request state, slices, deadlines.

Two faces: :class:`TransferBatch` is the caller's handle (``wait``, ``statuses``, ``cancel``…);
transports and the engine work on its :class:`BatchState` through :class:`Slice` and the
``*_slices`` functions below (``BatchState.fail`` for whole requests), never through the handle.

Threads: the submitting thread creates a batch; transport threads complete its slices; any thread
may ``wait``. A request is *final* once it has a status other than PENDING and *settled* once,
in addition, no transport thread touches its local memory any more ("pins"). ``wait`` returns
only settled requests as final, so after it reports FAILED or TIMEOUT the caller may reuse the
buffer: late bytes never land in it (a pinned stream is aborted at the deadline).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvconnect.errors import KVConnectError, TransferError, TransferTimeout
from kvconnect.transfer.memory import MemoryRegion
from kvconnect.transfer.types import TransferOp, TransferRequest, TransferStatus

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Slice:
    """A contiguous piece of one request, the unit transports move."""

    state: BatchState
    index: int
    local: MemoryRegion
    local_offset: int
    remote_region: int
    remote_offset: int
    length: int

    def done(self, error: KVConnectError | None = None) -> None:
        """Report this slice finished (``error`` None) or failed."""
        self.state.complete([self.index], error)


def pending_slices(slices: Sequence[Slice]) -> list[Slice]:
    """The slices whose requests still wait for them (not final yet)."""
    return _by_batch(slices, lambda batch, group: batch.pending(group))


def pin_slices(slices: Sequence[Slice], abort: Callable[[], None] | None = None) -> list[Slice]:
    """Announce access to the slices' local memory; returns those whose request is not final.

    ``abort`` interrupts the access (e.g. shuts a socket) if a request's deadline passes.
    Transports call this (and the two below) with slices of one batch: one lock per call.
    """
    return _by_batch(slices, lambda batch, group: batch.pin(group, abort))


def unpin_slices(slices: Sequence[Slice], abort: Callable[[], None] | None = None) -> None:
    """End the access announced by :func:`pin_slices`."""
    _by_batch(slices, lambda batch, group: batch.unpin(group, abort))


def complete_slices(slices: Sequence[Slice], error: KVConnectError | None = None) -> None:
    """Report slices finished (``error`` None) or failed."""
    _by_batch(slices, lambda batch, group: batch.complete([s.index for s in group], error))


def _by_batch(
    slices: Sequence[Slice],
    action: Callable[[BatchState, list[Slice]], list[Slice] | None],
) -> list[Slice]:
    out: list[Slice] = []
    start = 0
    while start < len(slices):
        batch = slices[start].state
        end = start + 1
        while end < len(slices) and slices[end].state is batch:
            end += 1
        out += action(batch, list(slices[start:end])) or []
        start = end
    return out


def make_slices(
    batch: BatchState, index: int, request: TransferRequest, slice_bytes: int
) -> list[Slice]:
    """Cut ``request`` into slices of at most ``slice_bytes``."""
    return [
        Slice(
            batch,
            index,
            request.local,
            request.local_offset + start,
            request.remote_region,
            request.remote_offset + start,
            min(slice_bytes, request.length - start),
        )
        for start in range(0, request.length, slice_bytes)
    ]


class BatchState:
    """The per-request state of one batch: what transports complete, pin and unpin (through
    slices), the engine fails and expires, and the caller's :class:`TransferBatch` reads."""

    def __init__(
        self,
        op: TransferOp,
        requests: Sequence[TransferRequest],
        deadline: float,
        slice_bytes: int,
        on_settled: Callable[[], None],
        *,
        settle_grace: float,
    ) -> None:
        """``on_settled`` runs once, on the thread that settles the last request.
        ``settle_grace``: how long past the deadline :meth:`wait` waits for requests to settle."""
        count = len(requests)
        self.op = op
        self.requests = tuple(requests)
        self.deadline = deadline
        self.settle_grace = settle_grace
        self._on_settled = on_settled
        self._cond = threading.Condition()
        self._status = [TransferStatus.PENDING] * count
        self._errors: list[KVConnectError | None] = [None] * count
        self._remaining = [-(-r.length // slice_bytes) for r in requests]  # slices per request
        self._pins = [0] * count
        self._aborts: dict[int, list[Callable[[], None]]] = {}
        self._settled = [False] * count
        self._unsettled = count
        # Settled, and the engine let go of the local regions (``on_settled`` ran): only then
        # does the caller see the batch done, so an unregister right after never finds it busy.
        self._released = count == 0
        self._callbacks: list[Callable[[], None]] = []

    # ------------------------------------------------------------------------- caller side

    def wait(self, timeout: float | None = None) -> tuple[TransferStatus, ...]:
        """:meth:`TransferBatch.wait`."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                now = time.monotonic()
                if self._released or (end is not None and now >= end):
                    return self._visible_locked()
                pending = TransferStatus.PENDING in self._status
                if not pending and now >= self.deadline + self.settle_grace:
                    log.warning("batch settling late: transport threads still hold its memory")
                    return self._visible_locked()
                if not pending or now < self.deadline:
                    wake = self.deadline if pending else self.deadline + self.settle_grace
                    wake = max(wake, now + 0.001)
                    self._cond.wait((wake if end is None else min(wake, end)) - now)
                    continue
            self.expire(now)

    def released(self) -> bool:
        """Whether every request has settled (and the batch let go of its regions)."""
        with self._cond:
            return self._released

    def add_settled_callback(self, callback: Callable[[], None]) -> None:
        """:meth:`TransferBatch.add_settled_callback`."""
        with self._cond:
            if not self._released:
                self._callbacks.append(callback)
                return
        callback()

    @property
    def statuses(self) -> tuple[TransferStatus, ...]:
        """Current per-request statuses (without waiting); final only once settled."""
        with self._cond:
            return self._visible_locked()

    def _visible_locked(self) -> tuple[TransferStatus, ...]:
        # A request is shown final only once settled: until then a transport thread may still
        # touch its memory, and a caller seeing FAILED would reuse the buffer.
        return tuple(
            status if settled else TransferStatus.PENDING
            for status, settled in zip(self._status, self._settled, strict=True)
        )

    @property
    def errors(self) -> tuple[KVConnectError | None, ...]:
        """Per-request errors (None where the request did not fail)."""
        with self._cond:
            return tuple(self._errors)

    def raise_for_status(self) -> None:
        """Raise TransferError (TransferTimeout if any request timed out) unless all completed."""
        statuses, errors = self.statuses, self.errors
        bad = [i for i, s in enumerate(statuses) if s is not TransferStatus.COMPLETED]
        if not bad:
            return
        first = bad[0]
        kind = (
            TransferTimeout
            if any(statuses[i] is TransferStatus.TIMEOUT for i in bad)
            else TransferError
        )
        raise kind(
            f"{len(bad)} of {len(statuses)} {self.op.value} request(s) did not complete; "
            f"request {first}: {statuses[first].value}: {errors[first]}",
            statuses=statuses,
            errors=errors,
        ) from errors[first]

    def cancel(self) -> None:
        """Mark every pending request CANCELED and stop touching its memory."""
        self._finalize(TransferStatus.CANCELED, lambda: None)

    # ----------------------------------------------------------------------- transport side

    def complete(self, indices: Sequence[int], error: KVConnectError | None) -> None:
        """One slice of each request in ``indices`` finished (``error`` None) or failed."""
        if error is not None:
            _drop_frames(error)
        with self._cond:
            for index in indices:
                if self._status[index] is not TransferStatus.PENDING:
                    continue
                if error is not None:
                    self._status[index] = TransferStatus.FAILED
                    self._errors[index] = error
                else:
                    self._remaining[index] -= 1
                    if self._remaining[index] == 0:
                        self._status[index] = TransferStatus.COMPLETED
            settled = self._settle_locked(indices)
        if settled:
            self._run_settled()

    def fail(self, index: int, error: KVConnectError) -> None:
        """Request ``index`` failed as a whole (refused before any slice was sent)."""
        self.complete([index], error)

    def pending(self, slices: list[Slice]) -> list[Slice]:
        """The slices (of this batch) whose request is not final yet."""
        with self._cond:
            return [p for p in slices if self._status[p.index] is TransferStatus.PENDING]

    def pin(self, slices: list[Slice], abort: Callable[[], None] | None) -> list[Slice]:
        """See :func:`pin_slices` (slices of this batch)."""
        pinned = []
        with self._cond:
            for piece in slices:
                if self._status[piece.index] is TransferStatus.PENDING:
                    self._pins[piece.index] += 1
                    if abort is not None:
                        self._aborts.setdefault(piece.index, []).append(abort)
                    pinned.append(piece)
        return pinned

    def unpin(self, slices: list[Slice], abort: Callable[[], None] | None) -> None:
        """See :func:`unpin_slices` (slices of this batch)."""
        with self._cond:
            for piece in slices:
                self._pins[piece.index] -= 1
                if abort is not None:
                    self._aborts[piece.index].remove(abort)
            settled = self._settle_locked([piece.index for piece in slices])
        if settled:
            self._run_settled()

    def expire(self, now: float) -> None:
        """Turn requests still pending into TIMEOUT if the deadline has passed at ``now``."""
        if now >= self.deadline:
            self._finalize(
                TransferStatus.TIMEOUT,
                lambda: TransferTimeout(f"{self.op.value} request missed its deadline"),
            )

    def _finalize(self, status: TransferStatus, error: Callable[[], KVConnectError | None]) -> None:
        aborts: list[Callable[[], None]] = []
        with self._cond:
            changed = []
            for index, current in enumerate(self._status):
                if current is not TransferStatus.PENDING:
                    continue
                self._status[index] = status
                self._errors[index] = error()
                aborts.extend(self._aborts.get(index, ()))
                changed.append(index)
            settled = self._settle_locked(changed)
            self._cond.notify_all()
        for abort in aborts:
            abort()
        if settled:
            self._run_settled()

    def _settle_locked(self, indices: Iterable[int]) -> bool:
        """Settle what can be; True when this settled the batch's last request."""
        if self._unsettled == 0:
            return False
        for index in indices:
            if (
                self._settled[index]
                or self._status[index] is TransferStatus.PENDING
                or self._pins[index]
            ):
                continue
            self._settled[index] = True
            self._unsettled -= 1
        if self._unsettled == 0:
            self._cond.notify_all()
            return True
        return False

    def _run_settled(self) -> None:
        self._on_settled()
        with self._cond:
            self._released = True
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a caller's callback must not break the transport thread
                log.exception("settled callback failed")

    def __repr__(self) -> str:
        statuses = self.statuses
        counts = {s.value: statuses.count(s) for s in TransferStatus if s in statuses}
        return f"TransferBatch({self.op.value}, {len(statuses)} requests, {counts})"


class TransferBatch:
    """Handle of submitted requests; see the module docstring for threads and guarantees."""

    def __init__(self, state: BatchState) -> None:
        """The engine creates handles; ``state`` is what its transports complete."""
        self._state = state
        self.op = state.op
        self.requests = state.requests
        self.deadline = state.deadline
        self.settle_grace = state.settle_grace

    def wait(self, timeout: float | None = None) -> tuple[TransferStatus, ...]:
        """Block until every request settles or ``timeout`` passes; return the statuses.

        Requests still PENDING when the batch deadline passes become TIMEOUT. Returns at the
        latest ``settle_grace`` after the deadline: a request a transport thread still holds
        then is returned as PENDING (its memory must not be reused before
        :meth:`add_settled_callback` fires).
        """
        return self._state.wait(timeout)

    def done(self) -> bool:
        """Whether every request has settled (and the batch let go of its regions)."""
        return self._state.released()

    def add_settled_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once every request has settled: at once (on this thread) if they
        have, else on the thread that settles the last one. For memory that :meth:`wait`
        returned as PENDING: the caller must not reuse it before this runs."""
        self._state.add_settled_callback(callback)

    @property
    def statuses(self) -> tuple[TransferStatus, ...]:
        """Current per-request statuses (without waiting); a request is shown final only once
        settled (until then a transport thread may still touch its memory)."""
        return self._state.statuses

    @property
    def errors(self) -> tuple[KVConnectError | None, ...]:
        """Per-request errors (None where the request did not fail)."""
        return self._state.errors

    def raise_for_status(self) -> None:
        """Raise TransferError (TransferTimeout if any request timed out) unless all completed."""
        self._state.raise_for_status()

    def cancel(self) -> None:
        """Mark every pending request CANCELED and stop touching its memory."""
        self._state.cancel()

    def __repr__(self) -> str:
        return repr(self._state)


def _drop_frames(error: BaseException) -> None:
    """Detach tracebacks: errors live on in batches, and transport frames hold whole buffers."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


class DeadlineWatch:
    """One thread that times out batches nobody is waiting on, so their resources are freed."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, weakref.ref[BatchState]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the watch thread."""
        self._thread = threading.Thread(target=self._run, name="kvconnect-deadlines", daemon=True)
        self._thread.start()

    def add(self, batch: BatchState) -> None:
        """Watch ``batch`` until its deadline."""
        with self._cond:
            heapq.heappush(self._heap, (batch.deadline, next(self._seq), weakref.ref(batch)))
            if self._heap[0][2]() is batch:
                self._cond.notify()

    def close(self) -> None:
        """Stop the thread. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due: list[BatchState] = []
                while self._heap and self._heap[0][0] <= now:
                    batch = heapq.heappop(self._heap)[2]()
                    if batch is not None:
                        due.append(batch)
                if not due:
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
                    continue
            for batch in due:
                batch.expire(now)
