"""Same-process transport: memcpy between engines that live in one process.

Engines publish their memory registry here at start; a copy acquires the peer's region through
that registry (bounds, permissions and user counts checked exactly as the listener would), so a
peer that unregisters or closes is refused, never read after free. A READ of a FILE region asks
its source, straight into the local region (through a bounce buffer for device memory).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from kvconnect.errors import AccessDenied, PeerUnreachable, SourceUnavailable
from kvconnect.transfer.batch import Slice, complete_slices, pin_slices, unpin_slices
from kvconnect.transfer.datapath.copying import Copier, CopyWorkers
from kvconnect.transfer.memory import MemoryKind, MemoryRegion, MemoryRegistry
from kvconnect.transfer.segment import SegmentDescriptor
from kvconnect.transfer.source import FileSource, read_source
from kvconnect.transfer.stats import Counters, TransportStats
from kvconnect.transfer.transports.base import TransportContext, TransportEntry
from kvconnect.transfer.types import Capabilities, TransferOp

_engines: weakref.WeakValueDictionary[str, MemoryRegistry] = weakref.WeakValueDictionary()
_engines_lock = threading.Lock()


def publish(engine_id: str, registry: MemoryRegistry) -> None:
    """Make an engine's registry reachable by engines of this process."""
    with _engines_lock:
        _engines[engine_id] = registry


def withdraw(engine_id: str) -> None:
    """Stop serving an engine (it is closing)."""
    with _engines_lock:
        _engines.pop(engine_id, None)


def _lookup(engine_id: str) -> MemoryRegistry | None:
    with _engines_lock:
        return _engines.get(engine_id)


class LocalTransport:
    """memcpy to and from engines in this process."""

    name = "local"
    capabilities = Capabilities(same_host_only=True, same_process_only=True)

    def __init__(self, copier: Copier, workers: CopyWorkers) -> None:
        self._copier = copier
        self._workers = workers
        self._counters = Counters(TransportStats)

    def submit(self, peer: SegmentDescriptor, op: TransferOp, slices: Sequence[Slice]) -> None:
        registry = _lookup(peer.engine_id)
        for group in self._workers.split(slices):
            # Copied here when small and in memory on both sides (a FILE region's source may
            # wait on a disk).
            if registry is not None and self._workers.inline(group) and _in_memory(registry, group):
                self._run(peer, op, group)
            else:
                self._workers.run(functools.partial(self._run, peer, op, group), group)

    def forget(self, engine_id: str) -> None:
        """Nothing is cached per peer."""

    def stats(self) -> TransportStats:
        return self._counters.snapshot()

    def close(self) -> None:
        """The copy workers belong to the engine, which closes them."""

    def _run(self, peer: SegmentDescriptor, op: TransferOp, group: list[Slice]) -> None:
        registry = _lookup(peer.engine_id)
        if registry is None:
            complete_slices(group, PeerUnreachable(f"segment {peer.name} is closed"))
            self._counters.add(errors=len(group))
            return
        pinned = pin_slices(group)
        held: list[MemoryRegion] = []
        copied: list[Slice] = []
        try:
            work, filled = self._gather(registry, op, pinned, held)
            copied = filled + self._copier.copy(op, work)
        finally:
            registry.release_many(held)
            unpin_slices(pinned)
        complete_slices(copied)
        key = "bytes_read" if op is TransferOp.READ else "bytes_written"
        self._counters.add(ops=len(copied), **{key: sum(p.length for p in copied)})

    def _gather(
        self,
        registry: MemoryRegistry,
        op: TransferOp,
        pinned: Sequence[Slice],
        held: list[MemoryRegion],
    ) -> tuple[list[tuple[Slice, memoryview | None, int]], list[Slice]]:
        """Acquire each piece's remote region (appended to ``held``, which the caller releases)
        and return the copier's work and the pieces already read from a FILE region's source.
        Pieces refused, or whose source failed, are completed with their error here."""
        work: list[tuple[Slice, memoryview | None, int]] = []
        filled: list[Slice] = []
        for piece in pinned:
            start = piece.remote_offset
            access, region = registry.acquire(
                piece.remote_region, start, piece.length, write=op is TransferOp.WRITE
            )
            if region is None:
                piece.done(AccessDenied(f"region {piece.remote_region}: {access.name}"))
                self._counters.add(errors=1)
                continue
            held.append(region)
            if region.kind is MemoryKind.FILE:
                try:
                    bounce = _read_source(region.source, piece)
                except SourceUnavailable as exc:
                    piece.done(exc)
                    self._counters.add(errors=1)
                    continue
                if bounce is None:
                    filled.append(piece)
                else:
                    work.append((piece, bounce, 0))
                continue
            view = (
                region.view[start : start + piece.length]
                if region.kind is MemoryKind.HOST
                else None
            )
            work.append((piece, view, region.address + start))
        return work, filled


def _in_memory(registry: MemoryRegistry, pieces: Sequence[Slice]) -> bool:
    """Whether every region the pieces name is host memory (a region withdrawn meanwhile is
    refused by the copy's acquire)."""
    for region_id in {piece.remote_region for piece in pieces}:
        region = registry.get(region_id)
        if region is None or region.kind is not MemoryKind.HOST:
            return False
    return True


def _read_source(source: FileSource, piece: Slice) -> memoryview | None:
    """Read ``piece``'s bytes from ``source``: straight into its local region when that is host
    memory (None: nothing left to copy), else into a bounce buffer, returned for the copier to
    move to the device. Raises SourceUnavailable."""
    local = piece.local
    if local.kind is MemoryKind.HOST:
        start = piece.local_offset
        read_source(source, piece.remote_offset, local.view[start : start + piece.length])
        return None
    bounce = np.empty(piece.length, dtype=np.uint8).data
    read_source(source, piece.remote_offset, bounce)
    return bounce


def _build(context: TransportContext) -> LocalTransport:
    return LocalTransport(context.copier, context.workers)


ENTRY = TransportEntry(LocalTransport.name, _build)
