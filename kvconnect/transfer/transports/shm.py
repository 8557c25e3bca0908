"""Same-host transport: map a peer's shared regions and copy once.

Regions created with ``TransferEngine.allocate`` live in memfd shared memory. A peer on the same
host asks the owner's Unix socket for the fd (SCM_RIGHTS, after the same handshake as TCP), maps
it and then copies directly, with no involvement of the owner. Bounds are checked against the
mapped length; the region's header word says whether the owner still has it registered (checked
before and after each copy), and the control connection tells whether the owner is alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import mmap
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvconnect.errors import AccessDenied, BrokenError, KVConnectError, PeerUnreachable
from kvconnect.transfer.batch import Slice, complete_slices, pin_slices, unpin_slices
from kvconnect.transfer.config import TransferConfig
from kvconnect.transfer.datapath.copying import Copier, CopyWorkers
from kvconnect.transfer.memory import SHM_HEADER, SHM_MAGIC, host_address, read_shm_header
from kvconnect.transfer.protocol import wire
from kvconnect.transfer.segment import SegmentDescriptor
from kvconnect.transfer.stats import Counters, TransportStats
from kvconnect.transfer.transports.base import TransportContext, TransportEntry
from kvconnect.transfer.types import Capabilities, TransferOp

_WATCH_INTERVAL = 1.0  # seconds between liveness checks of idle same-host peers
_POPULATE_CHUNK = 256 << 20
_MADV_POPULATE_READ = 22  # Linux >= 5.14
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)


def _populate_chunk(mapped: _Mapping) -> None:
    """Fault in the page tables of the next chunk (the kernel does it; the GIL is released)."""
    length = min(_POPULATE_CHUNK, mapped.length - mapped.populated)
    start = mapped.address + mapped.populated
    advice = _MADV_POPULATE_WRITE if mapped.writable else _MADV_POPULATE_READ
    # Failure (an old kernel, or the mapping just went away) only costs speed: give up on it.
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice):
        mapped.populated = mapped.length
    else:
        mapped.populated += length


@dataclass(slots=True)
class _Mapping:
    mapping: mmap.mmap
    data: memoryview
    length: int
    writable: bool
    address: int = 0
    populated: int = 0  # bytes whose page-table entries exist in this process

    def close(self) -> None:
        """Unmap now if no view is still in use (else the mapping goes with its last view)."""
        with contextlib.suppress(BufferError):
            self.data.release()
            self.mapping.close()

    def live(self, region_id: int) -> bool:
        magic, mapped_id, _length, state = read_shm_header(self.mapping)
        return magic == SHM_MAGIC and mapped_id == region_id and state == 1


class ShmTransport:
    """Copies through shared memory mapped from same-host peers."""

    name = "shm"
    capabilities = Capabilities(
        endpoint="shm",
        endpoint_label="shared-memory endpoint",
        same_host_only=True,
        shared_regions_only=True,
        memory_only=True,
    )

    def __init__(
        self,
        config: TransferConfig,
        copier: Copier,
        workers: CopyWorkers,
        on_lost: Callable[[SegmentDescriptor], None],
    ) -> None:
        self._config = config
        self._on_lost = on_lost
        self._copier = copier
        self._workers = workers
        self._counters = Counters(TransportStats)
        self._lock = threading.Lock()
        self._peers: dict[str, _ShmPeer] = {}
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None

    def submit(self, peer: SegmentDescriptor, op: TransferOp, slices: Sequence[Slice]) -> None:
        with self._lock:
            state = self._peers.get(peer.engine_id)
            if state is None:
                state = self._peers[peer.engine_id] = _ShmPeer(peer, self._config)
            else:
                state.update(peer)
            if self._watch is None and not self._stop.is_set():
                self._watch = threading.Thread(
                    target=self._watch_loop, name="kvconnect-shm-watch", daemon=True
                )
                self._watch.start()
        for group in self._workers.split(slices):
            maps = state.mapped_now(group) if self._workers.inline(group) else None
            if maps is not None:
                self._run(state, op, group, maps)
            else:
                self._workers.run(functools.partial(self._run, state, op, group), group)

    def forget(self, engine_id: str) -> None:
        with self._lock:
            state = self._peers.pop(engine_id, None)
        if state is not None:
            state.close()

    def stats(self) -> TransportStats:
        with self._lock:
            peers = len(self._peers)
        return dataclasses.replace(self._counters.snapshot(), peers=peers)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
            watch = self._watch
        for state in peers:  # the watch thread may be blocked on one of them
            state.interrupt()
        if watch is not None:
            watch.join(timeout=self._config.connect_timeout + 5)
        for state in peers:
            state.close()

    def _watch_loop(self) -> None:
        """Notice dead peers even when idle (their mappings pin all their memory), and map in
        the page tables of new mappings in the background, a chunk at a time: a first write to
        a page this process never touched costs a fault, which would halve copy speed."""
        next_check = 0.0
        while True:
            with self._lock:
                peers = list(self._peers.values())
            todo = next(
                (mp for st in peers for mp in st.mappings() if mp.populated < mp.length), None
            )
            if self._stop.wait(0 if todo is not None else _WATCH_INTERVAL):
                return
            if todo is not None:
                _populate_chunk(todo)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + _WATCH_INTERVAL
                for state in peers:
                    try:
                        state.check_alive()
                    except PeerUnreachable:
                        self._lost(state)

    def _run(
        self,
        state: _ShmPeer,
        op: TransferOp,
        group: list[Slice],
        maps: dict[int, _Mapping] | None = None,
    ) -> None:
        """Copy ``group``, check the owner kept it, complete it. ``maps``: the submitting
        thread's own copy of a small group whose regions are all mapped; nothing here waits
        then, and a check of the owner that would (a reconnection) is left to a worker."""
        inline = maps is not None
        maps = {} if maps is None else maps
        pinned = pin_slices(group)
        try:
            whole = self._copy_group(state, op, pinned, maps)
            copied = self._kept(state, whole, maps, wait=not inline)
        except (KVConnectError, OSError) as exc:
            self._failed(state, pinned, exc)
            return
        finally:
            unpin_slices(pinned)
        if copied is None:
            self._workers.run(functools.partial(self._settle, state, op, whole, maps), whole)
        else:
            self._complete(op, copied)

    def _settle(
        self, state: _ShmPeer, op: TransferOp, whole: list[Slice], maps: dict[int, _Mapping]
    ) -> None:
        """Complete slices copied inline once the owner's check (which may wait) is done."""
        try:
            copied = self._kept(state, whole, maps, wait=True)
        except (KVConnectError, OSError) as exc:
            self._failed(state, whole, exc)
            return
        assert copied is not None  # a check that may wait always decides
        self._complete(op, copied)

    def _complete(self, op: TransferOp, copied: list[Slice]) -> None:
        complete_slices(copied)
        key = "bytes_read" if op is TransferOp.READ else "bytes_written"
        self._counters.add(ops=len(copied), **{key: sum(p.length for p in copied)})

    def _failed(self, state: _ShmPeer, pieces: list[Slice], exc: KVConnectError | OSError) -> None:
        if isinstance(exc, PeerUnreachable):
            self._lost(state)  # first, so a caller retrying after the failure starts afresh
        if isinstance(exc, OSError):
            exc = BrokenError(f"shared-memory copy from {state.peer.name}: {exc}")
        self._fail(pieces, exc)

    def _fail(self, pieces: list[Slice], error: KVConnectError) -> None:
        complete_slices(pieces, error)
        self._counters.add(errors=len(pieces))

    def _lost(self, state: _ShmPeer) -> None:
        with self._lock:
            if self._peers.get(state.peer.engine_id) is not state:
                return
            del self._peers[state.peer.engine_id]
        state.close()
        self._on_lost(state.peer)

    def _copy_group(
        self, state: _ShmPeer, op: TransferOp, pieces: list[Slice], maps: dict[int, _Mapping]
    ) -> list[Slice]:
        """Copy what can be copied (``maps``: the regions mapped so far, added to); refuse
        single pieces; raise for the whole peer. Returns the pieces copied whole."""
        work: list[tuple[Slice, memoryview | None, int]] = []
        for piece in pieces:
            try:
                mapped = self._check(state, op, piece, maps)
            except AccessDenied as exc:
                self._fail([piece], exc)
                continue
            start = piece.remote_offset
            work.append((piece, mapped.data[start : start + piece.length], 0))
        return self._copier.copy(op, work)

    def _kept(
        self, state: _ShmPeer, whole: list[Slice], maps: dict[int, _Mapping], *, wait: bool
    ) -> list[Slice] | None:
        """The pieces copied whole whose bytes count; None if that cannot be told without
        waiting (and not ``wait``). The owner may have unregistered a region or died during the
        copies: then the bytes are not trustworthy (READ) or not kept (WRITE)."""
        if not state.check_alive(wait=wait):
            return None
        withdrawn = {region for region, mapped in maps.items() if not mapped.live(region)}
        copied = []
        for piece in whole:
            if piece.remote_region in withdrawn:
                self._fail([piece], AccessDenied(f"region {piece.remote_region} was withdrawn"))
            else:
                copied.append(piece)
        return copied

    def _check(
        self, state: _ShmPeer, op: TransferOp, piece: Slice, maps: dict[int, _Mapping]
    ) -> _Mapping:
        mapped = maps.get(piece.remote_region)
        if mapped is None:
            mapped = state.mapping(piece.remote_region)
            if not mapped.live(piece.remote_region):
                state.unmap(piece.remote_region)  # withdrawn or fenced: it never comes back
                raise AccessDenied(f"region {piece.remote_region}: UNKNOWN_REGION")
            maps[piece.remote_region] = mapped
        if piece.remote_offset + piece.length > mapped.length:
            raise AccessDenied(f"region {piece.remote_region}: OUT_OF_BOUNDS")
        if op is TransferOp.WRITE and not mapped.writable:
            raise AccessDenied(f"region {piece.remote_region}: READ_ONLY")
        return mapped


class _ShmPeer:
    """Control connection and mappings of one same-host peer engine."""

    def __init__(self, peer: SegmentDescriptor, config: TransferConfig) -> None:
        self.peer = peer
        self._config = config
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        # The socket a call under _lock waits on (a handshake or a control call): close()
        # interrupts it instead of waiting for _lock up to connect_timeout.
        self._busy: socket.socket | None = None
        self._closed = False
        self._maps: dict[int, _Mapping] = {}
        self._dead: str | None = None  # why the peer is unusable; each use raises afresh

    def mapping(self, region_id: int) -> _Mapping:
        """The mapped region (fetching its fd on first use)."""
        with self._lock:
            if self._dead is not None:
                raise PeerUnreachable(self._dead)
            mapped = self._maps.get(region_id)
            if mapped is None:
                mapped = self._maps[region_id] = self._map(region_id)
            return mapped

    def update(self, peer: SegmentDescriptor) -> None:
        """Take the peer's newest descriptor (it lists the regions we may map). Without the
        lock: a handshake may hold it for up to connect_timeout, and submit must not wait;
        readers take the reference once."""
        self.peer = peer

    def unmap(self, region_id: int) -> None:
        """Forget a region's mapping; it is unmapped with its last reference (a copy running
        in another thread may still hold it, so it is not closed here)."""
        with self._lock:
            self._maps.pop(region_id, None)

    def mappings(self) -> list[_Mapping]:
        """The mapped regions (a snapshot)."""
        with self._lock:
            return list(self._maps.values())

    def mapped_now(self, pieces: Sequence[Slice]) -> dict[int, _Mapping] | None:
        """The mappings of every region ``pieces`` name, if all are mapped and that can be
        told without waiting (another thread may hold the lock through a handshake)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._dead is not None or self._sock is None:
                return None
            maps = {}
            for piece in pieces:
                mapped = self._maps.get(piece.remote_region)
                if mapped is None:
                    return None
                maps[piece.remote_region] = mapped
            return maps
        finally:
            self._lock.release()

    def check_alive(self, *, wait: bool = True) -> bool:
        """Raise PeerUnreachable if the owner closed its end and cannot be reached again.
        True once the owner is known alive; False (only without ``wait``) when telling would
        wait: for the lock, or for a fresh handshake after the owner closed the connection."""
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            if self._dead is not None:
                raise PeerUnreachable(self._dead)
            sock = self._sock
            if sock is None:
                return True
            # The socket has a timeout, so recv would wait: ask poll whether anything is there.
            if not select.select([sock], [], [], 0)[0]:
                return True
            try:
                data = sock.recv(1, socket.MSG_PEEK)
            except OSError:
                data = b""
            if data:
                return True
            if not wait:
                return False
            # EOF: the owner died, or closed an idle connection. Only a fresh handshake tells.
            sock.close()
            self._sock = None
            try:
                self._connect()
            except PeerUnreachable as exc:
                self._dead = str(exc)
                self._maps.clear()
                raise
            return True
        finally:
            self._lock.release()

    def interrupt(self) -> None:
        """End a handshake or control call blocked on an unresponsive peer (e.g. a stopped
        process) now; the peer is unusable from here on."""
        self._closed = True
        busy = self._busy  # read without _lock: its holder may be the blocked call
        if busy is not None:
            wire.interrupt(busy)

    def close(self) -> None:
        self.interrupt()
        with self._lock:
            self._dead = self._dead or f"segment {self.peer.name}: closed"
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            maps, self._maps = list(self._maps.values()), {}
        for mapped in maps:
            mapped.close()

    def _connect(self) -> socket.socket:
        endpoint = self.peer.endpoints.get("shm")
        if endpoint is None:
            raise PeerUnreachable(f"segment {self.peer.name} offers no shared-memory endpoint")
        try:
            sock, engine_id = wire.open_connection(
                endpoint, self._config.token, self._config.connect_timeout, self._calling
            )
        finally:
            self._busy = None
        if engine_id.hex() != self.peer.engine_id:
            sock.close()
            raise PeerUnreachable(f"segment {self.peer.name} restarted")
        self._sock = sock
        return sock

    def _calling(self, sock: socket.socket) -> None:
        # Under _lock: publish the socket a call is about to block on (see interrupt()).
        self._busy = sock
        if self._closed:
            wire.interrupt(sock)

    def _map(self, region_id: int) -> _Mapping:
        info = self.peer.region(region_id)
        if info is None:
            raise AccessDenied(f"region {region_id}: UNKNOWN_REGION")
        deadline = wire.deadline_after(self._config.connect_timeout)
        sock = self._sock or self._connect()
        try:
            self._calling(sock)
            reply, fds = wire.control_call(sock, wire.GetRegionFd(region_id), deadline)
        except OSError as exc:
            sock.close()
            self._sock = None
            raise PeerUnreachable(f"segment {self.peer.name}: {exc}") from exc
        finally:
            self._busy = None
        try:
            if isinstance(reply, wire.ErrorReply):
                raise AccessDenied(f"region {region_id}: {reply.message}")
            if not isinstance(reply, wire.RegionFdReply) or len(fds) != 1:
                raise BrokenError(f"segment {self.peer.name}: bad region fd reply")
            size = os.fstat(fds[0]).st_size  # whole pages: huge-page regions are rounded up
            if size < SHM_HEADER + reply.length:
                raise BrokenError(f"segment {self.peer.name}: region {region_id} fd is too short")
            # A read-only region comes as a read-only fd: map it so.
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if info.writable else 0)
            mapping = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            for fd in fds:
                os.close(fd)
        data = memoryview(mapping)[SHM_HEADER : SHM_HEADER + reply.length]
        mapped = _Mapping(mapping, data, reply.length, info.writable, host_address(data))
        if not mapped.live(region_id):
            raise AccessDenied(f"region {region_id}: mapped memory is not the live region")
        return mapped


def _build(context: TransportContext) -> ShmTransport:
    return ShmTransport(context.config, context.copier, context.workers, context.on_lost)


ENTRY = TransportEntry(ShmTransport.name, _build)
