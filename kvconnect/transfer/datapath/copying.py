"""Copy workers shared by the memcpy transports (same process, same host).

Copies run on a small pool of threads so ``submit`` never blocks; each job moves a group of
slices. Host-to-host copies go through the data path (GIL released with the native extension);
anything touching device memory goes through the CUDA copier. Jobs copy in chunks of
``_COPY_CHUNK`` and drop the slices of requests that ended (deadline, cancel, failure) before
each chunk, so a copy lets go of a request's memory within one chunk of its deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvconnect.errors import BrokenError, ClosedError, KVConnectError
from kvconnect.transfer.batch import Slice, complete_slices, pending_slices
from kvconnect.transfer.datapath.cuda import DeviceCopier
from kvconnect.transfer.datapath.iov import DataPath
from kvconnect.transfer.memory import MemoryKind, host_address
from kvconnect.transfer.types import TransferOp

log = logging.getLogger(__name__)


_MIN_JOB = 1 << 20  # below this, handing work to a second thread costs more than it saves
# A group of at most this much host memory in at most this many pieces is copied by the
# submitting thread: up to ~100 µs of memcpy and little Python, where a hand-off to a worker
# and back costs two thread wake-ups (tens of µs each on small VMs) and, on a 2-core host, a
# second core the store's other processes need. Small enough that ``submit`` returns at once.
_INLINE_BYTES = 1 << 20
_INLINE_PIECES = 16
_COPY_CHUNK = 4 << 20  # bytes copied between two looks at the requests' state (~0.5-4 ms)


class CopyWorkers:
    """A fixed pool of copy threads."""

    def __init__(self, threads: int, max_job: int) -> None:
        self._threads = threads
        self._max_job = max_job
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvconnect-copy")
        self._closed = False

    def split(self, slices: Sequence[Slice]) -> Iterator[list[Slice]]:
        """Jobs for ``slices``: one per thread when there is enough to share, none over
        ``max_job`` bytes (so big batches complete piece by piece)."""
        total = sum(piece.length for piece in slices)
        share = -(-total // self._threads)
        return group_slices(slices, min(max(share, _MIN_JOB), self._max_job))

    def inline(self, group: Sequence[Slice]) -> bool:
        """Whether a transport should copy ``group`` (a job of :meth:`split`) in the
        submitting thread rather than :meth:`run` it: a few pieces of host memory, a MiB at
        most (a transport also makes sure that nothing on its way waits)."""
        return (
            not self._closed
            and len(group) <= _INLINE_PIECES
            and sum(piece.length for piece in group) <= _INLINE_BYTES
            and all(piece.local.kind is MemoryKind.HOST for piece in group)
        )

    def run(self, job: Callable[[], None], slices: Sequence[Slice]) -> None:
        """Run ``job`` on a worker; if that is impossible, fail ``slices`` with ClosedError."""
        if not self._closed:
            try:
                self._pool.submit(_guarded, job, slices)
                return
            except RuntimeError:
                pass
        complete_slices(slices, ClosedError("engine closed"))

    def close(self) -> None:
        """Finish running jobs and stop. Idempotent."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=False)


def _guarded(job: Callable[[], None], slices: Sequence[Slice]) -> None:
    try:
        job()
    except Exception as exc:  # a worker must never die silently; fail what it was doing
        log.exception("copy job failed")
        error = exc if isinstance(exc, KVConnectError) else BrokenError(f"copy failed: {exc}")
        complete_slices(slices, error)


def group_slices(slices: Sequence[Slice], max_bytes: int) -> Iterator[list[Slice]]:
    """Consecutive groups of about ``max_bytes`` (at least one slice each)."""
    group: list[Slice] = []
    size = 0
    for piece in slices:
        if group and size + piece.length > max_bytes:
            yield group
            group, size = [], 0
        group.append(piece)
        size += piece.length
    if group:
        yield group


@dataclass(slots=True)
class _Piece:
    """Bytes [start, start + length) of one slice."""

    slice: Slice
    start: int
    length: int
    remote_view: memoryview | None
    remote_address: int


def _chunks(
    work: Sequence[tuple[Slice, memoryview | None, int]], chunk: int
) -> Iterator[list[_Piece]]:
    """The work cut, in order, into lists of pieces of ``chunk`` bytes in all (the last less)."""
    group: list[_Piece] = []
    room = chunk
    for piece, remote_view, remote_address in work:
        start = 0
        while start < piece.length:
            length = min(room, piece.length - start)
            group.append(_Piece(piece, start, length, remote_view, remote_address))
            start += length
            room -= length
            if not room:
                yield group
                group, room = [], chunk
    if group:
        yield group


class Copier:
    """Copies slices between their local regions and remote host views or device addresses."""

    def __init__(self, datapath: DataPath, device: Callable[[], DeviceCopier]) -> None:
        self._datapath = datapath
        self._device = device

    def copy(
        self, op: TransferOp, work: Sequence[tuple[Slice, memoryview | None, int]]
    ) -> list[Slice]:
        """Move each ``(slice, remote_view, remote_address)`` (READ: remote → local) of pinned
        slices; returns the slices copied whole.

        ``remote_view`` is the remote bytes when they are host memory; otherwise it is None and
        ``remote_address`` is a device address. Before each chunk, slices whose request is no
        longer pending are dropped (their bytes stop there); they are not returned.
        """
        dropped: set[int] = set()
        for chunk in _chunks(work, _COPY_CHUNK):
            wanted = [p.slice for p in chunk if id(p.slice) not in dropped]
            live = {id(s) for s in pending_slices(wanted)}
            dropped.update(id(s) for s in wanted if id(s) not in live)
            self._copy_chunk(op, [p for p in chunk if id(p.slice) in live])
        return [piece for piece, _view, _address in work if id(piece) not in dropped]

    def _copy_chunk(self, op: TransferOp, chunk: Sequence[_Piece]) -> None:
        local_views: list[memoryview] = []
        remote_views: list[memoryview] = []
        for p in chunk:
            local = p.slice.local
            start = p.slice.local_offset + p.start
            if local.kind is MemoryKind.HOST and p.remote_view is not None:
                local_views.append(local.view[start : start + p.length])
                remote_views.append(p.remote_view[p.start : p.start + p.length])
                continue
            local_address = local.address + start
            remote = (
                p.remote_address if p.remote_view is None else host_address(p.remote_view)
            ) + p.start
            if op is TransferOp.READ:
                self._device().copy(local_address, remote, p.length)
            else:
                self._device().copy(remote, local_address, p.length)
        if not local_views:
            return
        if op is TransferOp.READ:
            self._datapath.copy_many(local_views, remote_views)
        else:
            self._datapath.copy_many(remote_views, local_views)
