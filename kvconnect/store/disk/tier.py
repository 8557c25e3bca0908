"""One disk tier of a store server: write-behind demotions, verified loads and reads, faults.

Threads: the caller of :meth:`DiskTier.apply` and :meth:`DiskTier.load` (the server's heartbeat
thread) never waits for the disk; a writer thread group-commits demotions, a loader thread runs
promotions, a watchdog thread takes the tier down when an operation is stuck or the file is gone,
and :attr:`DiskTier.source` reads on the caller's thread (the engine's listener). Every shared
field is guarded by one lock, never held across disk I/O.
"""

from __future__ import annotations

import collections
import errno
import gc
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvconnect.errors import DiskUnavailable, SourceUnavailable
from kvconnect.lifecycle import Closing
from kvconnect.store.disk.checksum import chunk_crcs
from kvconnect.store.disk.extents import Extents
from kvconnect.store.disk.files import BLOCK, DataFile, StagingPool, round_up
from kvconnect.store.disk.index import (
    HEADER_BYTES,
    IndexLog,
    Record,
    encode_del,
    encode_put,
    put_length,
)
from kvconnect.store.disk.reading import Bounces, Fault, ReadFault, verified
from kvconnect.store.disk.stats import DiskStats, Meters
from kvconnect.store.disk.watchdog import OpsInFlight
from kvconnect.store.messages import Change, Moved
from kvconnect.transfer.source import FileSource

__all__ = ["DiskOutcomes", "DiskStats", "DiskTier"]

log = logging.getLogger(__name__)

COMPACT_MIN = 1 << 20
"""An index is compacted only once larger than this (and than twice its live records)."""
_POLL = 1.0  # seconds a worker waits on its condition before looking again
_RUN_BYTES = 8 << 20  # most bytes written by one call
_RUN_BUFFERS = 256  # and most buffers (the kernel takes at most IOV_MAX, 1024)
_FAILING_READS = 3
"""Bad reads in a row (errors or mismatches, no good read between) that mean the device is
failing rather than one object is bad."""


class DiskOutcomes(NamedTuple):
    """Outcomes since the last :meth:`DiskTier.take_outcomes`."""

    demoted: list[Moved]  # done, for the disk mount (offset = disk offset)
    demote_failed: list[Moved]  # for the disk mount
    lost: list[Moved]  # for the disk mount: objects that can no longer be served
    loaded: list[Moved]  # promotions done, for the DRAM mount (offset = the load's token)
    load_failed: list[Moved]  # for the DRAM mount


@dataclass(eq=False)
class _Write:
    key: str
    offset: int
    size: int
    buffer: mmap.mmap  # page-aligned staging copy, zero-padded to BLOCK
    crcs: bytes  # of the staging copy, taken while it is hot in the cache


@dataclass(eq=False)
class _Load:
    key: str
    offset: int
    size: int
    dst: memoryview
    token: int
    abandoned: bool = False  # reported failed: no byte may land in dst any more


class DiskTier(Closing):
    """A data file (``path``) and its index (``path.with_suffix(".index")``) of ``size`` bytes.

    Build, :meth:`open`, use, :meth:`close`. Thread-safe.
    """

    def __init__(
        self,
        path: Path,
        size: int,
        *,
        queue_bytes: int,
        timeout: float,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        """No I/O and no threads until :meth:`open`. ``wake`` is called (from any of the tier's
        threads, no lock held) when :meth:`take_outcomes` has something new."""
        self.path = path
        self.size = size - size % BLOCK
        """Bytes usable: what the disk segment offers."""
        self._queue_bytes = queue_bytes
        self._timeout = timeout
        self._wake = wake
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._ops = OpsInFlight()
        self._bounces = Bounces()
        self._meters = Meters()
        self._objects = Extents()
        self._used = 0
        self._live_index = 0  # bytes the live objects' PUT records take
        self._queued: collections.deque[_Write] = collections.deque()
        self._writing: list[_Write] = []
        self._writing_at: set[int] = set()
        self._staged = 0
        self._pool = StagingPool()  # staging buffers, at most queue_bytes with those staged
        self._dels: list[bytes] = []
        self._loads: collections.deque[_Load] = collections.deque()
        self._loading: _Load | None = None
        self._loading_at: collections.Counter[int] = collections.Counter()
        self._bad_reads = 0  # reads that failed since the last good one (any thread)
        self._out = DiskOutcomes([], [], [], [], [])
        self._up = False
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._data: DataFile | None = None
        self._index: IndexLog | None = None
        self.source: FileSource = _Source(self)
        """What the server registers with ``engine.register_source``."""

    @property
    def up(self) -> bool:
        """True from :meth:`open` until the tier is taken out (a fault) or closed."""
        return self._up

    def open(self) -> list[Change]:
        """Create and preallocate the files, or recover them; start the threads.

        Returns the recovered objects ``Change(key, offset, size)`` in offset order. Blocks for
        the recovery (seconds for millions of objects). Raises DiskUnavailable.
        """
        began = time.monotonic()
        index_path = self.path.with_suffix(".index")
        try:
            self._data = DataFile(self.path, self.size)
            index_path.with_name(index_path.name + ".tmp").unlink(missing_ok=True)
            self._index, replay = IndexLog.open(index_path, min(self.size, self._data.length))
        except BlockingIOError as e:
            self.close()
            raise DiskUnavailable(f"{self.path} is in use by another process") from e
        except (OSError, ValueError) as e:
            self.close()
            raise DiskUnavailable(f"disk tier {self.path}: {e}") from e
        self._recover(replay.records)
        self._meters.recovered(time.monotonic() - began, len(replay.records), replay.dropped)
        log.info(
            "disk tier %s: %d objects recovered in %.2f s (%d dropped), O_DIRECT %s",
            self.path,
            len(replay.records),
            time.monotonic() - began,
            replay.dropped,
            "on" if self._data.direct else "off",
        )
        self._up = True
        for name, target in (
            ("writer", self._write_loop),
            ("loader", self._load_loop),
            ("watchdog", self._watch_loop),
        ):
            thread = threading.Thread(target=target, name=f"kvconnect-disk-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return [Change(r.key, r.offset, r.size) for r in replay.records]

    def apply(self, change: Change, dram: memoryview) -> bool:
        """Apply one change of the disk mount's journal (journal order; heartbeat thread).

        A MOVE (``source_region`` set) copies ``dram[source_offset:+size]`` into staging now
        and writes it behind; it fails at once (``demote_failed``) when the tier is down, the
        change is out of bounds or the staging queue is full. A release (``key`` empty) forgets
        the object at ``offset``. A commit (``key`` set, no source) names an object a move
        already wrote: nothing to do. Returns False (not now: retry at the next heartbeat) for a
        release of an offset a write or a load is still using. Never waits for the disk.
        """
        if change.source_region:
            self._demote(change, dram)
            return True
        if change.key:
            return True
        return self._release(change.offset)

    def load(self, key: str, offset: int, size: int, dst: memoryview, token: int) -> None:
        """Promote: read the object at ``offset`` verified into ``dst`` on the loader thread.

        The outcome is ``Moved(key, token)`` in ``loaded`` or ``load_failed``; once it is
        reported nothing more is written to ``dst``. Never waits for the disk.
        """
        with self._lock:
            ok = self._up and not self._closed and len(dst) >= size
            if ok:
                self._loads.append(_Load(key, offset, size, dst, token))
                self._loading_at[offset] += 1
                self._work.notify_all()
            else:
                self._meters.count(loads_failed=1)
                self._out.load_failed.append(Moved(key, token))
        if not ok:
            self._wake()

    def held(self) -> list[Change]:
        """The objects held now ``Change(key, offset, size)``, in offset order (what a new
        mount reports)."""
        with self._lock:
            records = sorted(self._objects, key=lambda r: r.offset)
        return [Change(r.key, r.offset, r.size) for r in records]

    def busy(self) -> int:
        """Moves and loads queued or running. A load may still write its ``dst``; a move,
        once durable, is held (and reported by a new mount)."""
        with self._lock:
            return (
                len(self._loads)
                + (self._loading is not None)
                + len(self._queued)
                + len(self._writing)
            )

    def take_outcomes(self) -> DiskOutcomes:
        """Every outcome since the last call (any thread)."""
        with self._lock:
            out, self._out = self._out, DiskOutcomes([], [], [], [], [])
        return out

    def stats(self) -> DiskStats:
        """A snapshot of the counters and latency histograms (any thread)."""
        index = self._index
        with self._lock:
            return self._meters.snapshot(
                capacity=self.size,
                used=self._used,
                objects=len(self._objects),
                queue_bytes=self._staged,
                up=self._up,
                direct=self._data.direct if self._data else False,
                index_records=index.records if index else 0,
                index_bytes=index.length if index else 0,
            )

    def close(self) -> None:
        """Write what is queued, stop the threads and close the files. Idempotent.

        A thread stuck in the kernel past ``timeout`` keeps its descriptors open (closing them
        under it could let its I/O land in a file opened later with the same number).
        """
        with self._lock:
            self._closed = True
            self._work.notify_all()
        for thread in self._threads[:2]:  # the writer drains its queue first
            thread.join(self._timeout + _POLL)
        self._stop.set()
        for thread in self._threads[2:]:
            thread.join(_POLL)
        stuck = [t.name for t in self._threads if t.is_alive()]
        self._up = False
        if stuck:
            log.warning("disk tier %s: %s stuck in I/O at close; files left open", self.path, stuck)
            return
        for file in (self._data, self._index):
            if file is not None:
                file.close()

    # -- journal changes (heartbeat thread) -------------------------------------------------

    def _demote(self, change: Change, dram: memoryview) -> None:
        reserve, src = round_up(change.size), change.source_offset
        with self._lock:
            ok = (
                self._up
                and not self._closed
                and change.size > 0
                and change.offset % BLOCK == 0
                and change.offset + reserve <= self.size
                and 0 <= src <= len(dram) - change.size
                and self._staged + reserve <= self._queue_bytes
                and change.offset not in self._writing_at
            )
            if ok:
                self._staged += reserve
        if ok:
            buffer = self._pool.take(change.size)
            buffer[: change.size] = dram[src : src + change.size]
            crcs = chunk_crcs(memoryview(buffer)[: change.size])
            with self._lock:
                ok = self._up  # if not, _go_down dropped the reservation
                if ok:
                    self._queued.append(
                        _Write(change.key, change.offset, change.size, buffer, crcs)
                    )
                    self._writing_at.add(change.offset)
                    self._work.notify_all()
        if not ok:
            with self._lock:
                self._meters.count(demotions_failed=1)
                self._out.demote_failed.append(Moved(change.key, change.offset))
            self._wake()

    def _release(self, offset: int) -> bool:
        with self._lock:
            if self._up and (offset in self._writing_at or self._loading_at[offset]):
                return False
            record = self._forget(offset)
            if record is not None and self._up:
                self._dels.append(encode_del(offset))
                self._work.notify_all()
        return True

    # -- the object table (lock held) ----------------------------------------------------

    def _install(self, record: Record) -> None:
        for old in self._objects.overlapping(record.offset, record.size):
            log.warning(
                "disk tier %s: %r at %d overwritten by %r",
                self.path,
                old.key,
                old.offset,
                record.key,
            )
            self._forget(old.offset)
        self._objects.add(record)
        self._used += record.size
        self._live_index += put_length(record)

    def _recover(self, records: list[Record]) -> None:
        """Index what replay found (non-overlapping, in offset order), collector paused."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._objects.load(records)
            self._used = sum(r.size for r in records)
            self._live_index = sum(put_length(r) for r in records)
        finally:
            if collecting:
                gc.enable()

    def _forget(self, offset: int) -> Record | None:
        record = self._objects.remove(offset)
        if record is not None:
            self._used -= record.size
            self._live_index -= put_length(record)
        return record

    # -- the writer thread ---------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while self._up and not (self._queued or self._dels or self._closed):
                    self._work.wait(_POLL)
                if not self._up or not (self._queued or self._dels):
                    return
                self._writing = jobs = list(self._queued)
                self._queued.clear()
                dels, self._dels = self._dels, []
            try:
                records = self._commit(jobs, dels)
                self._finish(jobs, records)
                self._compact()
            except OSError as e:
                self._go_down(e.errno or errno.EIO, f"write: {e.strerror}")
                return

    def _commit(self, jobs: list[_Write], dels: list[bytes]) -> list[Record]:
        """Group commit: DELs durable before their space is written again, then the data,
        fdatasync, the PUT records, fdatasync. Raises OSError."""
        data, index = self._data, self._index
        assert data is not None
        assert index is not None
        if dels:
            with self._ops.track("index append"):
                index.append(dels)
                index.sync()
        records = [Record(job.key, job.offset, job.size, job.crcs) for job in jobs]
        for run in _runs(jobs):
            began = time.monotonic()
            with self._ops.track("write"):
                data.write(run[0].offset, [job.buffer for job in run])
            self._meters.wrote(time.monotonic() - began, sum(len(job.buffer) for job in run))
        if jobs:
            with self._ops.track("data fdatasync"):
                data.sync()
            with self._ops.track("index append"):
                index.append([encode_put(r) for r in records])
                index.sync()
        return records

    def _finish(self, jobs: list[_Write], records: list[Record]) -> None:
        with self._lock:
            if not self._up:  # the watchdog already reported these failed
                return
            for job, record in zip(jobs, records, strict=True):
                self._writing_at.discard(job.offset)
                self._staged -= round_up(job.size)
                self._pool.give(job.buffer, self._queue_bytes - self._staged)
                self._install(record)
                self._out.demoted.append(Moved(job.key, job.offset))
            self._meters.count(demotions=len(jobs))
            self._writing = []
        if jobs:
            self._wake()

    def _compact(self) -> None:
        index = self._index
        assert index is not None
        with self._lock:
            if index.length <= max(COMPACT_MIN, 2 * (HEADER_BYTES + self._live_index)):
                return
            live = list(self._objects)  # any order: replay sorts
        with self._ops.track("index compaction"):
            index.compact(live)
        self._meters.count(compactions=1)

    # -- the loader thread ---------------------------------------------------------------

    def _load_loop(self) -> None:
        while True:
            with self._lock:
                while self._up and not self._loads and not self._closed:
                    self._work.wait(_POLL)
                if not self._up or not self._loads:
                    return
                job = self._loading = self._loads.popleft()
                record = self._objects.at(job.offset)
            ok = (
                record is not None
                and (record.key, record.size) == (job.key, job.size)
                and self._load(job, record)
            )
            with self._lock:
                self._loading = None
                self._loading_at[job.offset] -= 1
                if not self._loading_at[job.offset]:
                    del self._loading_at[job.offset]
                if job.abandoned:
                    continue
                self._meters.count(loads=int(ok), loads_failed=int(not ok))
                (self._out.loaded if ok else self._out.load_failed).append(
                    Moved(job.key, job.token)
                )
            self._wake()

    def _load(self, job: _Load, record: Record) -> bool:
        try:
            for pos, window in verified(
                self._bounces, self._data_file(), record, 0, job.size, self._ops, self._meters.read
            ):
                with self._lock:
                    if job.abandoned:
                        return False
                    job.dst[pos : pos + len(window)] = window
        except ReadFault as fault:
            self._fault(record, fault)
            return False
        self._bad_reads = 0
        return True

    # -- reads (the listener's threads) --------------------------------------------------

    def read_into(self, offset: int, view: memoryview) -> None:
        """The FileSource read: ``view`` gets bytes [offset, +len(view)) of one object, all
        verified, or SourceUnavailable is raised (the object is then lost if its bytes are bad).
        """
        with self._lock:
            record = self._objects.covering(offset) if self._up else None
        if record is None or offset + len(view) > record.offset + record.size:
            raise SourceUnavailable(
                f"disk tier {self.path}: no object holds [{offset}, "
                f"+{len(view)}){'' if self._up else ' (tier down)'}"
            )
        try:
            for pos, window in verified(
                self._bounces,
                self._data_file(),
                record,
                offset - record.offset,
                len(view),
                self._ops,
                self._meters.read,
            ):
                view[pos : pos + len(window)] = window
        except ReadFault as fault:
            self._fault(record, fault)
            raise SourceUnavailable(f"disk tier {self.path}: {fault}") from fault
        self._bad_reads = 0

    def _data_file(self) -> DataFile:
        assert self._data is not None
        return self._data

    def _fault(self, record: Record, fault: ReadFault) -> None:
        """A bad chunk or a bad sector loses the object; a file shorter than it was, any
        other error, or ``_FAILING_READS`` bad reads in a row (a failing device, not a bad
        sector) take the tier down."""
        if fault.fault is Fault.MISMATCH:
            self._meters.count(checksum_failures=1)
        else:
            self._meters.count(read_errors=1)
        self._bad_reads += 1
        failing = self._bad_reads >= _FAILING_READS
        if (
            failing
            or fault.fault is Fault.SHORT
            or (fault.fault is Fault.ERROR and fault.errno != errno.EIO)
        ):
            why = f"{self._bad_reads} bad reads in a row, the last" if failing else "read"
            self._go_down(fault.errno or errno.EIO, f"{why}: {fault}")
            return
        with self._lock:
            if self._objects.at(record.offset) is not record:
                return  # already lost (or released) by another reader
            self._forget(record.offset)
            self._dels.append(encode_del(record.offset))
            self._out.lost.append(Moved(record.key, record.offset))
            self._meters.count(lost=1)
            self._work.notify_all()
        log.warning("disk tier %s: %r lost (%s)", self.path, record.key, fault)
        self._wake()

    # -- faults --------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        interval = min(max(self._timeout / 4, 0.01), _POLL)
        while not self._stop.wait(interval) and self._up:
            problem = self._ops.stuck(self._timeout)
            if problem is not None:
                self._go_down(errno.ETIMEDOUT, f"{problem} stuck for over {self._timeout} s")
                return
            problem_errno, why = self._file_problem()
            if problem_errno:
                self._go_down(problem_errno, why)
                return

    def _file_problem(self) -> tuple[int, str]:
        """(errno, what) when the data file was removed, replaced or shortened, or the index
        is gone; (0, "") when both are as they should be."""
        data = self._data_file()
        try:
            st, fst = os.stat(self.path), os.fstat(data.fd)
            os.stat(self.path.with_suffix(".index"))
        except OSError as e:
            return e.errno or errno.EIO, f"stat: {e.strerror}"
        if (st.st_dev, st.st_ino) != (fst.st_dev, fst.st_ino):
            return errno.ENOENT, "data file removed or replaced"
        if fst.st_size < self.size:
            return errno.EIO, f"data file truncated to {fst.st_size} bytes"
        return 0, ""

    def _go_down(self, err: int, why: str) -> None:
        """Take the tier out (once): every queued or in-flight move fails, reads are refused."""
        with self._lock:
            if not self._up:
                return
            self._up = False
            writes = [*self._writing, *self._queued]
            loads = [*self._loads, *([self._loading] if self._loading else [])]
            self._writing, self._staged, self._dels = [], 0, []
            self._queued.clear()
            self._loads.clear()
            self._writing_at.clear()
            for load in loads:
                load.abandoned = True
            self._out.demote_failed.extend(Moved(w.key, w.offset) for w in writes)
            self._out.load_failed.extend(Moved(ld.key, ld.token) for ld in loads)
            self._meters.count(demotions_failed=len(writes), loads_failed=len(loads))
            self._work.notify_all()
        log.error(
            "disk tier %s is down: %s (errno %s)",
            self.path,
            why,
            errno.errorcode.get(err, str(err)),
        )
        self._wake()


def _runs(jobs: list[_Write]) -> list[list[_Write]]:
    """The jobs as runs of adjacent space, each written with one call (the master allocates a
    round of evictions back to back); at most ``_RUN_BYTES`` and ``_RUN_BUFFERS`` per run."""
    runs: list[list[_Write]] = []
    end = -1
    for job in sorted(jobs, key=lambda job: job.offset):
        run = runs[-1] if runs else None
        if (
            run is not None
            and job.offset == end
            and end - run[0].offset < _RUN_BYTES
            and len(run) < _RUN_BUFFERS
        ):
            run.append(job)
        else:
            runs.append([job])
        end = job.offset + len(job.buffer)
    return runs


class _Source:
    """The tier as a FileSource (a separate object, so the engine sees only ``read_into``)."""

    def __init__(self, tier: DiskTier) -> None:
        self._tier = tier

    def read_into(self, offset: int, view: memoryview) -> None:
        """See :meth:`DiskTier.read_into`."""
        self._tier.read_into(offset, view)
