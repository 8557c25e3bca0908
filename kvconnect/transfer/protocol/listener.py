"""The engine's listener: serves peers' READs and WRITEs into registered memory, and control calls.

One TCP socket (the configured interface only) and, for same-host peers, one abstract Unix socket
(which can also hand over shared-memory fds). One thread per connection, which after answering a
small frame polls for the next one for ``poll_window`` before it sleeps (at most
``poll_threads`` threads poll at once); each request frame is
validated against the registry before a byte moves, and a malformed frame closes only its own
connection. READs of FILE regions are filled from their source before the answer; a source that
fails gets the frame answered UNAVAILABLE, and the connection goes on. Every blocking call has a
timeout: ``connect_timeout`` for the whole handshake, ``idle_timeout`` between frames,
``io_timeout`` for a frame's header, entries and control message together, and for each stall
of its payload.

Connections still in their handshake are counted apart (at most ``max_handshakes``; one more
drops the oldest of them), so unauthenticated clients can take neither the
``max_connections`` slots of authenticated peers nor their turn to authenticate.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence

from kvconnect.errors import AuthenticationError, KVConnectError, ProtocolError, SourceUnavailable
from kvconnect.transfer.config import TransferConfig
from kvconnect.transfer.datapath import polling
from kvconnect.transfer.datapath.iov import DataPath
from kvconnect.transfer.datapath.staging import StagingPool, Window, close_all, host_views
from kvconnect.transfer.memory import MemoryRegion, MemoryRegistry
from kvconnect.transfer.protocol import wire
from kvconnect.transfer.protocol.wire import FrameKind, Status
from kvconnect.transfer.segment import SegmentDescriptor, encode_descriptor
from kvconnect.transfer.stats import Counters, LatencyHistogram, ListenerStats

log = logging.getLogger(__name__)

_DISCARD_CHUNK = 1 << 20


class Listener:
    """Accepts peers and serves them until :meth:`close`."""

    def __init__(
        self,
        config: TransferConfig,
        registry: MemoryRegistry,
        describe: Callable[[], SegmentDescriptor],
        engine_id: bytes,
        datapath: DataPath,
        staging: Callable[[], StagingPool],
        rdma: Callable[[wire.RdmaConnect], wire.ControlReply] | None = None,
        also: Callable[[], Sequence[str]] = tuple,
    ) -> None:
        """``rdma`` answers RDMA connect requests (None: refused, the engine has no RDMA);
        ``also``: tokens peers may prove besides the cluster token (asked per handshake)."""
        self._config = config
        self._rdma = rdma
        self._also = also
        self._registry = registry
        self._describe = describe
        self._engine_id = engine_id
        self._datapath = datapath
        self._staging = staging
        self.counters = Counters(ListenerStats)
        self.latency = LatencyHistogram()
        self._lock = threading.Lock()
        self._servers: list[socket.socket] = []
        self._connections: set[socket.socket] = set()  # every open one, for close()
        self._handshaking: dict[socket.socket, None] = {}  # oldest first
        self._authenticated = 0
        self._threads: set[threading.Thread] = set()
        self._pollers = threading.Semaphore(config.poll_threads)  # threads that may poll now
        self._closed = False
        self.endpoints: dict[str, str] = {}

    def start(self) -> None:
        """Bind and start accepting. Raises OSError if the address is taken."""
        cfg = self._config
        tcp = socket.create_server(
            (cfg.listen_host, cfg.listen_port),
            family=socket.AF_INET6 if ":" in cfg.listen_host else socket.AF_INET,
            backlog=128,
        )
        self._servers.append(tcp)
        port = tcp.getsockname()[1]
        host = cfg.advertise_host or cfg.listen_host
        self.endpoints["tcp"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if cfg.shm:
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            name = f"kvconnect-{self._engine_id.hex()}"
            unix.bind("\0" + name)
            unix.listen(128)
            self._servers.append(unix)
            self.endpoints["shm"] = "@" + name
        for server in self._servers:
            self._spawn(self._accept_loop, server, name="kvconnect-accept")

    def close(self) -> None:
        """Stop accepting, drop every connection, join threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            servers, self._servers = self._servers, []
            connections = list(self._connections)
        for sock in servers + connections:
            wire.shutdown_quietly(sock)
        for sock in servers:
            sock.close()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)

    def stats(self) -> ListenerStats:
        """Counters since start."""
        return self.counters.snapshot()

    # ------------------------------------------------------------------------------ threads

    def _spawn(self, target: Callable[..., None], *args: object, name: str) -> None:
        thread = threading.Thread(target=self._run, args=(target, *args), name=name, daemon=True)
        with self._lock:
            if self._closed:
                return
            self._threads.add(thread)
        thread.start()

    def _run(self, target: Callable[..., None], *args: object) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _accept_loop(self, server: socket.socket) -> None:
        while True:
            try:
                conn, _addr = server.accept()
            except OSError:
                return  # closed
            dropped = 0
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                full = self._authenticated >= self._config.max_connections
                if not full:
                    self._connections.add(conn)
                    self._handshaking[conn] = None
                    dropped = self._drop_oldest_handshake_locked()
            if full:  # a flood of connections must not become a flood of threads
                self.counters.add(refused=1)
                log.warning("refused a connection: %d already open", self._config.max_connections)
                conn.close()
                continue
            self.counters.add(connections=1, handshakes_dropped=dropped)
            self._spawn(self._serve, conn, name="kvconnect-serve")

    def _drop_oldest_handshake_locked(self) -> int:
        """Over ``max_handshakes``, cut the connection longest in its handshake (a real peer's
        takes a round trip, so the oldest is the slowest); its thread then ends and closes it.

        Shut down under the lock: the thread closes the socket only after leaving
        ``_connections`` under it, so the descriptor cannot have been reused.
        """
        if len(self._handshaking) <= self._config.max_handshakes:
            return 0
        oldest = next(iter(self._handshaking))
        del self._handshaking[oldest]
        wire.shutdown_quietly(oldest)
        return 1

    def _admit(self, conn: socket.socket) -> bool:
        """``conn`` finished its handshake: take an authenticated slot, if one is free and the
        connection was not dropped meanwhile."""
        with self._lock:
            if conn not in self._handshaking:
                return False  # dropped for a newer handshake (and already shut down)
            del self._handshaking[conn]
            if self._authenticated >= self._config.max_connections:
                self.counters.add(refused=1)
                return False
            self._authenticated += 1
            return True

    def _serve(self, conn: socket.socket) -> None:
        admitted = False
        try:
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = wire.deadline_after(self._config.connect_timeout)
            try:
                wire.server_handshake(
                    conn, self._config.token, self._engine_id, deadline, self._also()
                )
            except TimeoutError:
                self.counters.add(handshake_timeouts=1)
                log.debug("closed a connection that did not finish its handshake in time")
                return
            admitted = self._admit(conn)
            if admitted:
                _Session(self, conn).run()
        except AuthenticationError as exc:
            self.counters.add(auth_failures=1)
            log.warning("refused a peer connection: %s", exc)
        except KVConnectError as exc:
            self.counters.add(protocol_errors=1)
            log.debug("closing peer connection: %s", exc)
        except OSError as exc:
            log.debug("peer connection ended: %s", exc)
        except Exception:  # a bug must cost one connection, never the listener
            self.counters.add(protocol_errors=1)
            log.exception("closing a peer connection after an unexpected error")
        finally:
            with self._lock:
                self._connections.discard(conn)
                self._handshaking.pop(conn, None)
                self._authenticated -= admitted
            conn.close()


class _Session:
    """One authenticated connection's request loop."""

    def __init__(self, listener: Listener, conn: socket.socket) -> None:
        self.listener = listener
        self.conn = conn
        self.config = listener._config
        self.datapath = listener._datapath
        self.deadline = 0.0  # by which the current frame's entries or control message are in

    def run(self) -> None:
        header = bytearray(wire.HEADER.size)
        carried = 0  # bytes the last frame carried
        while True:
            if carried <= wire.SMALL_FRAME_BYTES:
                self._poll()
            deadline = _recv_header(self.conn, header, self.config)
            if deadline is None:
                return
            self.deadline = deadline
            kind, _status, count, aux, frame_id = wire.HEADER.unpack(header)
            carried = 0
            if kind not in (FrameKind.READ, FrameKind.WRITE, FrameKind.CONTROL):
                raise ProtocolError(f"unknown frame kind {kind}")
            # Counters move before the answer goes out: a peer that saw the answer sees them.
            self.listener.counters.add(frames=1)
            if kind == FrameKind.CONTROL:
                self._control(aux, frame_id)
            else:
                start = time.perf_counter()
                carried = self._data_frame(FrameKind(kind), count, frame_id)
                self.listener.latency.observe(time.perf_counter() - start)

    def _poll(self) -> None:
        """After a small frame, poll for the peer's next frame for ``poll_window`` (if no
        more than ``poll_threads`` other threads poll now): one that comes soon then finds
        this thread awake, which saves the peer's ``send`` and this thread a wake-up."""
        window = self.config.poll_window
        if window and self.listener._pollers.acquire(blocking=False):
            try:
                polling.wait_readable(self.conn.fileno(), window, window)
            finally:
                self.listener._pollers.release()

    def _recv_bounded(self, size: int) -> bytes:
        """``size`` bytes of the current frame's metadata, by its deadline; then the socket is
        back at ``io_timeout`` (what the payload and the response get)."""
        data = wire.recv_exact(self.conn, size, self.deadline)
        self.conn.settimeout(self.config.io_timeout)
        return data

    def _data_frame(self, kind: FrameKind, count: int, frame_id: int) -> int:
        """Serve one READ or WRITE frame; returns the bytes it asked to move."""
        if not 0 < count <= wire.MAX_ENTRIES:
            raise ProtocolError(f"frame with {count} entries")
        flat = wire.unpack_entries(self._recv_bounded(wire.ENTRY.size * count), count)
        lengths = flat[2::3]
        total = sum(lengths)
        if total > self.config.max_frame_bytes:
            raise ProtocolError(f"frame of {total} bytes exceeds max_frame_bytes")
        registry = self.listener._registry
        access, regions = registry.acquire_many(flat, write=kind == FrameKind.WRITE)
        if not regions:
            self.listener.counters.add(refused=1)
            log.debug("refused a %s frame: %s", kind.name, access.name)
        try:
            if kind == FrameKind.WRITE:
                self._serve_write(Status(access), regions, flat, total, frame_id)
            else:
                self._serve_read(Status(access), regions, flat, total, frame_id)
        finally:
            registry.release_many(regions)
        return total

    def _views(
        self, regions: list[MemoryRegion], flat: tuple[int, ...]
    ) -> tuple[list[memoryview], list[Window]]:
        entries = zip(regions, flat[1::3], flat[2::3], strict=True)
        return host_views(entries, self.listener._staging)

    def _serve_write(
        self,
        status: Status,
        regions: list[MemoryRegion],
        flat: tuple[int, ...],
        total: int,
        frame_id: int,
    ) -> None:
        if status is not Status.OK:
            self._discard(total)  # keep the stream in sync; nothing is written
        else:
            views, staged = self._views(regions, flat)
            try:
                self.datapath.recvv(self.conn, views, self.config.io_timeout)
                for window in staged:
                    window.store()
            finally:
                close_all(staged)
            self.listener.counters.add(bytes_received=total)
        self.conn.sendall(wire.HEADER.pack(FrameKind.RESPONSE, status, 0, 0, frame_id))

    def _serve_read(
        self,
        status: Status,
        regions: list[MemoryRegion],
        flat: tuple[int, ...],
        total: int,
        frame_id: int,
    ) -> None:
        if status is not Status.OK:
            self.conn.sendall(wire.HEADER.pack(FrameKind.RESPONSE, status, 0, 0, frame_id))
            return
        views, staged = self._views(regions, flat)
        try:
            status = self._load(staged)
            header = memoryview(wire.HEADER.pack(FrameKind.RESPONSE, status, 0, 0, frame_id))
            if status is not Status.OK:
                self.conn.sendall(header)
                return
            self.listener.counters.add(bytes_served=total)
            self.datapath.sendv(self.conn, [header, *views], self.config.io_timeout)
        finally:
            close_all(staged)

    def _load(self, windows: list[Window]) -> Status:
        """Fill a READ frame's windows before its header goes out: OK, or UNAVAILABLE when a
        FILE region's source failed (the frame is answered without payload and the connection
        keeps serving: the other ranges and frames are not at fault)."""
        try:
            for window in windows:
                window.load()
        except SourceUnavailable as exc:
            self.listener.counters.add(unavailable=1)
            log.debug("answered a READ frame UNAVAILABLE: %s", exc)
            return Status.UNAVAILABLE
        return Status.OK

    def _discard(self, total: int) -> None:
        scratch = memoryview(bytearray(min(total, _DISCARD_CHUNK)))
        while total:
            n = self.conn.recv_into(scratch[: min(total, scratch.nbytes)])
            if n == 0:
                raise ConnectionResetError("peer closed the connection")
            total -= n

    def _control(self, size: int, frame_id: int) -> None:
        if size > wire.MAX_CONTROL_BYTES:
            raise ProtocolError(f"control message of {size} bytes")
        request = wire.decode_request(self._recv_bounded(size))
        fd: int | None = None
        if isinstance(request, wire.GetSegment):
            reply: wire.ControlReply = wire.SegmentReply(
                encode_descriptor(self.listener._describe())
            )
        elif isinstance(request, wire.RdmaConnect):
            rdma = self.listener._rdma
            reply = (
                rdma(request)
                if rdma is not None
                else wire.ErrorReply(Status.BAD_REQUEST, "this engine has no RDMA transport")
            )
        else:
            reply, fd = self._region_fd(request.region_id)
        payload = wire.encode_control(reply)
        data = wire.HEADER.pack(FrameKind.RESPONSE, 0, 0, len(payload), frame_id) + payload
        try:
            if fd is not None:
                socket.send_fds(self.conn, [data], [fd])
            else:
                self.conn.sendall(data)
        finally:
            if fd is not None:
                os.close(fd)

    def _region_fd(self, region_id: int) -> tuple[wire.ControlReply, int | None]:
        """The reply to a region fd request and a duplicate of the fd to send with it (the
        caller closes it). The duplicate is taken under a hold of the region and the hold ends
        at once: a slow send never keeps the owner from unregistering, and a peer that maps a
        region unregistered meanwhile finds it withdrawn in the region's header."""
        if self.conn.family != socket.AF_UNIX:
            return wire.ErrorReply(Status.BAD_REQUEST, "fds only travel over the Unix socket"), None
        access, region = self.listener._registry.acquire(region_id, 0, 1, write=False)
        if region is None:
            self.listener.counters.add(refused=1)
            return wire.ErrorReply(Status(access), f"region {region_id}: {access.name}"), None
        try:
            if not region.shareable:
                return wire.ErrorReply(
                    Status.BAD_REQUEST, f"region {region_id} is not shared"
                ), None
            return wire.RegionFdReply(region_id, region.length), os.dup(region.shared_fd)
        finally:
            self.listener._registry.release(region)


def _recv_header(conn: socket.socket, header: bytearray, config: TransferConfig) -> float | None:
    """Read one frame header; None on a clean close or an idle timeout between frames.

    Returns the frame's deadline: its header, entries and control message must all arrive
    within ``io_timeout`` of its first byte. Leaves the socket's timeout at ``io_timeout``
    (the payload's stall timeout).
    """
    conn.settimeout(config.idle_timeout)
    view = memoryview(header)
    try:
        got = conn.recv_into(view)
    except TimeoutError:
        return None
    if got == 0:
        return None
    deadline = wire.deadline_after(config.io_timeout)
    if got < len(header):
        view[got:] = wire.recv_exact(conn, len(header) - got, deadline)
    conn.settimeout(config.io_timeout)
    return deadline
