"""TCP transport: several pipelined streams per peer, bytes straight between sockets and memory.

Per peer engine a *channel* holds a queue of frames and ``tcp_streams`` streams. Each stream has
a sender thread (takes the next frame, sends header + payload with one vectored send from the
registered memory) and, per connection, a receiver thread (reads responses in order, a READ's
payload straight into registered memory with ``recv_into``). Up to ``stream_window`` frames are
in flight per stream. A small frame (``wire.SMALL_FRAME_BYTES``) submitted while a stream's
connection is idle is sent by the submitting thread itself, which saves the hand-off to the
sender thread (most of a small request's latency): an idle connection's send buffer is empty
(the peer answered everything it was sent), so that send fits in it and cannot block. That
thread then polls for the response for ``poll_window`` and, if it arrives, reads it and
completes the frame itself, so a small request costs no thread wake-up on this side; a response
that takes longer is left to the receiver thread.

Failures: a broken connection requeues its in-flight frames for the other streams (at most
``max_retries`` times per frame) and reconnects; a peer that refuses connections or turned out
to be another engine fails the channel's queued work at once with PeerUnreachable. A READ frame
answered UNAVAILABLE (a FILE region's source failed on one of its entries, and the status does
not say which) is asked again one slice per frame, so only the slices at fault fail, with
SourceUnavailable.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvconnect.errors import (
    AccessDenied,
    BrokenError,
    ClosedError,
    KVConnectError,
    PeerUnreachable,
    ProtocolError,
    SourceUnavailable,
    TransferError,
)
from kvconnect.transfer.batch import (
    Slice,
    complete_slices,
    pending_slices,
    pin_slices,
    unpin_slices,
)
from kvconnect.transfer.config import TransferConfig
from kvconnect.transfer.datapath import polling
from kvconnect.transfer.datapath.iov import DataPath
from kvconnect.transfer.datapath.staging import StagingPool, Window, close_all, host_views
from kvconnect.transfer.memory import MemoryKind
from kvconnect.transfer.protocol import wire
from kvconnect.transfer.protocol.wire import FrameKind, Status
from kvconnect.transfer.segment import SegmentDescriptor
from kvconnect.transfer.stats import Counters, TransportStats
from kvconnect.transfer.transports.base import TransportContext, TransportEntry
from kvconnect.transfer.types import Capabilities, TransferOp

log = logging.getLogger(__name__)

_ACCESS_STATUSES = {Status.UNKNOWN_REGION, Status.OUT_OF_BOUNDS, Status.READ_ONLY}
_SCRATCH = memoryview(bytearray(1 << 20))  # sink for bytes of requests that already ended


@dataclass(slots=True, eq=False)
class Frame:
    """Slices of one op sent as one request frame."""

    op: TransferOp
    slices: list[Slice]
    attempts: int = 0
    frame_id: int = 0
    sent: list[Slice] = field(default_factory=list)


def plan_frames(
    op: TransferOp, slices: Sequence[Slice], frame_bytes: int, max_entries: int
) -> list[Frame]:
    """Coalesce consecutive slices into frames of at most ``frame_bytes`` and ``max_entries``."""
    frames: list[Frame] = []
    current: list[Slice] = []
    size = 0
    for piece in slices:
        if current and (size + piece.length > frame_bytes or len(current) >= max_entries):
            frames.append(Frame(op, current))
            current, size = [], 0
        current.append(piece)
        size += piece.length
    if current:
        frames.append(Frame(op, current))
    return frames


class TcpTransport:
    """Moves slices over TCP to any reachable peer."""

    name = "tcp"
    capabilities = Capabilities(endpoint="tcp", endpoint_label="TCP endpoint")

    def __init__(
        self,
        config: TransferConfig,
        datapath: DataPath,
        staging: Callable[[], StagingPool],
        on_lost: Callable[[SegmentDescriptor], None],
    ) -> None:
        self.config = config
        self.datapath = datapath
        self.staging = staging
        self._on_lost = on_lost
        self.counters = Counters(TransportStats)
        self._frame_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._channels: dict[str, _Channel] = {}
        self._closed = False

    def submit(self, peer: SegmentDescriptor, op: TransferOp, slices: Sequence[Slice]) -> None:
        frames = plan_frames(op, slices, self.config.slice_bytes, self.config.max_frame_entries)
        while True:
            with self._lock:
                channel = None if self._closed else self._channels.get(peer.engine_id)
                if channel is None and not self._closed:
                    channel = self._channels[peer.engine_id] = _Channel(self, peer)
            if channel is None:
                fail_frames(frames, ClosedError("engine closed"))
                return
            if len(frames) == 1 and _direct(frames[0]) and channel.send_now(frames[0]):
                return
            if channel.enqueue(frames):
                return
            # The channel retired for idleness just now: a fresh one takes the frames.

    def forget(self, engine_id: str) -> None:
        with self._lock:
            channel = self._channels.pop(engine_id, None)
        if channel is not None:
            channel.close(BrokenError(f"segment {channel.peer.name} was withdrawn"))

    def stats(self) -> TransportStats:
        with self._lock:
            peers = len(self._channels)
        return dataclasses.replace(self.counters.snapshot(), peers=peers)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close(ClosedError("engine closed"))

    def next_frame_id(self) -> int:
        """A connection-unique id to match responses with requests."""
        return next(self._frame_ids)

    def channel_lost(self, channel: _Channel) -> None:
        """``channel`` failed for good: drop it so the next submit re-resolves the peer."""
        self.channel_retired(channel)
        self._on_lost(channel.peer)

    def channel_retired(self, channel: _Channel) -> None:
        """``channel`` ends (idle or failed): the next submit to its peer gets a new one."""
        with self._lock:
            if self._channels.get(channel.peer.engine_id) is channel:
                del self._channels[channel.peer.engine_id]


def _small(frame: Frame) -> bool:
    """Whether ``frame`` moves at most ``wire.SMALL_FRAME_BYTES``."""
    return sum(piece.length for piece in frame.slices) <= wire.SMALL_FRAME_BYTES


def _direct(frame: Frame) -> bool:
    """Whether the submitting thread may send ``frame`` itself: a READ (its request is only
    entries) or a small WRITE, of host memory only (device memory would need staging)."""
    if any(piece.local.kind is not MemoryKind.HOST for piece in frame.slices):
        return False
    return frame.op is TransferOp.READ or _small(frame)


def _inline_window(frame: Frame, poll_window: float) -> float:
    """How long the submitting thread of a directly sent ``frame`` waits for its response
    itself: ``poll_window`` (never past the frame's deadline) for a WRITE (its response is a
    header) or a small READ; 0 for a larger READ (its payload is the receiver thread's work)."""
    if frame.op is TransferOp.READ and not _small(frame):
        return 0.0
    deadline = min(piece.state.deadline for piece in frame.slices)
    return max(0.0, min(poll_window, deadline - time.monotonic()))


def fail_frames(frames: Sequence[Frame], error: KVConnectError) -> None:
    """Fail every slice of ``frames``."""
    for frame in frames:
        complete_slices(frame.slices, error)


class _Retired(ClosedError):
    """Marks a channel that ended for idleness; its frames go to a new channel."""


class _Channel:
    """The frame queue and streams of one peer engine.

    A channel with nothing to do for ``idle_timeout`` retires (its streams close their
    connections and end), so peers that come and go leave no threads or sockets behind.
    """

    def __init__(self, transport: TcpTransport, peer: SegmentDescriptor) -> None:
        self.transport = transport
        self.peer = peer
        self.config = transport.config
        self._cond = threading.Condition()
        self._queue: deque[Frame] = deque()
        self._error: KVConnectError | None = None
        self._streams = [_Stream(self, n) for n in range(self.config.tcp_streams)]
        self._started = False
        self._busy = 0  # frames taken by senders and not yet handed to a connection
        self._last_active = time.monotonic()

    def enqueue(self, frames: list[Frame]) -> bool:
        """Queue ``frames``; False (frames untouched) if the channel retired for idleness."""
        with self._cond:
            error = self._error
            if error is None:
                self._queue.extend(frames)
                self._cond.notify_all()
                start, self._started = not self._started, True
        if isinstance(error, _Retired):
            return False
        if error is not None:
            fail_frames(frames, error)
            return True
        if start:
            for stream in self._streams:
                stream.start()
        return True

    def take(self) -> Frame | None:
        """Next frame to send, or None once the channel is closed or retired."""
        idle = self.config.idle_timeout
        with self._cond:
            while not self._queue and self._error is None:
                if not self._cond.wait(idle) and self._idle_locked(idle):
                    self._error = _Retired("idle")
                    self._cond.notify_all()
                    self.transport.channel_retired(self)
            if self._error is not None:
                return None
            self._busy += 1
            self._last_active = time.monotonic()
            return self._queue.popleft()

    def send_now(self, frame: Frame) -> bool:
        """Send ``frame`` on this thread if nothing is queued and a stream's connection is
        idle; False (frame untouched) otherwise. Counted busy meanwhile, like a frame a sender
        took, so the channel cannot retire under it."""
        with self._cond:
            if self._error is not None or self._queue:
                return False
            open_ = [conn for conn in (s.connection() for s in self._streams) if conn is not None]
            if not open_:
                return False
            self._busy += 1
            self._last_active = time.monotonic()
        try:
            return any(conn.try_send(frame) for conn in open_)
        finally:
            self.handed_over()

    def handed_over(self) -> None:
        """A frame from :meth:`take` is now sent (or requeued or failed)."""
        with self._cond:
            self._busy -= 1
            self._last_active = time.monotonic()

    def _idle_locked(self, idle: float) -> bool:
        return (
            not self._queue
            and not self._busy
            and time.monotonic() - self._last_active >= idle
            and all(stream.quiet() for stream in self._streams)
        )

    def requeue(self, frames: list[Frame], cause: BaseException) -> None:
        """Give frames of a broken connection to the other streams, or fail them."""
        retry: list[Frame] = []
        failed: list[Frame] = []
        for frame in frames:
            frame.attempts += 1
            (retry if frame.attempts <= self.config.max_retries else failed).append(frame)
        with self._cond:
            error = self._error
            if error is None:
                self._queue.extendleft(reversed(retry))
                self._cond.notify_all()
        self.transport.counters.add(retries=len(retry))
        if error is not None:
            failed += retry
        broken = error or BrokenError(f"stream to {self.peer.name} broke: {cause}")
        if failed:
            self.transport.counters.add(errors=sum(len(f.slices) for f in failed))
            fail_frames(failed, broken)

    def resend(self, frames: list[Frame]) -> None:
        """Send ``frames`` next (a frame the peer answered as a whole, asked again in parts);
        fails them if the channel has ended."""
        with self._cond:
            error = self._error
            if error is None:
                self._queue.extendleft(reversed(frames))
                self._cond.notify_all()
        if error is not None:
            fail_frames(frames, error)

    def fail(self, error: KVConnectError) -> None:
        """The peer is gone: drop the channel, then fail its queued frames and stop streams.

        Dropping first means a caller that sees the failure and retries gets a fresh channel.
        """
        self.transport.channel_lost(self)
        self.close(error)

    def close(self, error: KVConnectError) -> None:
        with self._cond:
            if self._error is not None:
                return
            self._error = error
            frames = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        fail_frames(frames, error)
        for stream in self._streams:
            stream.close()


class _Stream:
    """One sender thread; (re)connects on demand."""

    def __init__(self, channel: _Channel, number: int) -> None:
        self.channel = channel
        self.number = number
        self._conn: _Connection | None = None
        self._connecting: socket.socket | None = None  # its handshake is in progress
        self._closing = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        thread = threading.Thread(
            target=self._run, name=f"kvconnect-tcp-send-{self.number}", daemon=True
        )
        # Published only once started: a sibling stream whose connect failed at once closes
        # the channel, and must never join a thread that is not running yet.
        with self._lock:
            thread.start()
            self._thread = thread

    def close(self) -> None:
        """Interrupt the current connection (or the handshake of the next) and wait for the
        sender thread to finish."""
        with self._lock:
            self._closing = True
            conn = self._conn
            connecting = self._connecting
            thread = self._thread
        if conn is not None:
            conn.abort()
        if connecting is not None:
            wire.interrupt(connecting)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def quiet(self) -> bool:
        """No response outstanding on this stream's connection."""
        conn = self._conn
        return conn is None or conn.quiet()

    def connection(self) -> _Connection | None:
        """The current connection, if any (:meth:`_Connection.try_send` checks it is idle)."""
        return self._conn

    def _run(self) -> None:
        try:
            while True:
                frame = self.channel.take()
                if frame is None:
                    return
                conn = self._conn
                if conn is None or conn.broken:
                    if conn is not None:
                        conn.dispose()
                    try:
                        conn = self._connect()
                    except KVConnectError as exc:
                        self.channel.requeue([frame], exc)
                        self.channel.handed_over()
                        self.channel.fail(exc)
                        return
                conn.send(frame)
                self.channel.handed_over()
        finally:
            with self._lock:
                conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()
                conn.dispose()

    def _connect(self) -> _Connection:
        channel = self.channel
        endpoint = channel.peer.endpoints.get("tcp")
        if endpoint is None:
            raise PeerUnreachable(f"segment {channel.peer.name} has no TCP endpoint")
        try:
            sock, engine_id = wire.open_connection(
                endpoint, channel.config.token, channel.config.connect_timeout, self._opened
            )
        finally:
            with self._lock:
                self._connecting = None
        if engine_id.hex() != channel.peer.engine_id:
            sock.close()
            raise PeerUnreachable(
                f"segment {channel.peer.name} restarted (another engine answers at {endpoint})"
            )
        conn = _Connection(channel, sock)
        with self._lock:
            self._conn = conn
        conn.start()
        return conn

    def _opened(self, sock: socket.socket) -> None:
        # A handshake with a peer that accepted but never answers would hold close() for up
        # to connect_timeout: close() shuts the socket down instead.
        with self._lock:
            self._connecting = sock
            closing = self._closing
        if closing:
            wire.interrupt(sock)


class _Connection:
    """One socket: the sender thread writes frames, a receiver thread reads responses."""

    def __init__(self, channel: _Channel, sock: socket.socket) -> None:
        self.channel = channel
        self.transport = channel.transport
        self.sock = sock
        self.broken = False
        self._cond = threading.Condition()
        # Held while a frame goes out: the sender thread and a submitting thread (try_send)
        # must not interleave bytes, and responses are matched in send order.
        self._sending = threading.Lock()
        self._inflight: deque[Frame] = deque()
        # The frame whose response its submitting thread reads itself (see try_send): the
        # receiver thread leaves the socket alone meanwhile.
        self._inline: Frame | None = None
        self._receiver = threading.Thread(
            target=self._receive_loop, name="kvconnect-tcp-recv", daemon=True
        )
        sock.settimeout(channel.config.io_timeout)

    def start(self) -> None:
        self._receiver.start()

    def quiet(self) -> bool:
        """No frame awaits its response."""
        with self._cond:
            return not self._inflight

    def dispose(self) -> None:
        """Called by the sender thread once the connection is broken (its socket shut down):
        reap it.

        Only then is the socket closed, so no thread can use a recycled file descriptor: the
        native loops send and receive on the bare descriptor, and one still running after
        the close would move a frame's bytes through the next connection that gets the same
        number (its handshake then fails). So the receiver thread is joined, and a submitting
        thread that sends or reads on this connection (it holds the send lock) is waited for.
        """
        timeout = self.channel.config.io_timeout
        if self._receiver.is_alive() and self._receiver is not threading.current_thread():
            self._receiver.join(timeout=timeout)
        if self._sending.acquire(timeout=timeout):
            self._sending.release()
        self.sock.close()

    def abort(self) -> None:
        """Interrupt any I/O (deadline passed, or closing); the loops then fail."""
        wire.shutdown_quietly(self.sock)

    def send(self, frame: Frame) -> None:
        """Send ``frame`` (waits for window space). Failures requeue; never raises."""
        with self._sending:
            with self._cond:
                while len(self._inflight) >= self.channel.config.stream_window and not self.broken:
                    self._cond.wait()
                broken = self.broken
            if broken:
                self.channel.requeue([frame], BrokenError("connection broke"))
            else:
                self._send(frame)

    def try_send(self, frame: Frame) -> bool:
        """Send ``frame`` now if no other thread is sending and nothing is in flight; False
        (frame untouched) otherwise. Failures requeue, as in :meth:`send`. A small frame's
        response is then awaited here for up to ``poll_window`` (see
        :meth:`_complete_inline`); nothing else is sent on this connection meanwhile."""
        if not self._sending.acquire(blocking=False):
            return False
        try:
            window = _inline_window(frame, self.channel.config.poll_window)
            with self._cond:
                if self.broken or self._inflight:
                    return False
                if window:
                    self._inline = frame
            self._send(frame)
            if window:
                self._complete_inline(frame, window)
            return True
        finally:
            self._sending.release()

    def _complete_inline(self, frame: Frame, window: float) -> None:
        """Read the response to ``frame`` (just sent by this thread) here if it arrives within
        ``window`` seconds; otherwise hand the frame to the receiver thread."""
        with self._cond:
            sent = not self.broken and bool(self._inflight) and self._inflight[0] is frame
        if not sent or not polling.wait_readable(self.sock.fileno(), window, window):
            with self._cond:
                self._inline = None
                self._cond.notify_all()  # the receiver thread takes it from here
            return
        try:
            status = self._receive(frame, bytearray(wire.HEADER.size))
        except (OSError, KVConnectError) as exc:
            self._fail(exc)  # requeues the frame, still in flight
            with self._cond:
                self._inline = None
            return
        with self._cond:  # in one step: the receiver thread must never see it half retired
            self._inline = None
            mine = not self.broken and bool(self._inflight) and self._inflight[0] is frame
            if mine:
                self._inflight.popleft()
        if mine:
            self.transport.counters.add(inline=1)
            self._complete(frame, status)

    def _send(self, frame: Frame) -> None:
        if frame.op is TransferOp.WRITE:
            self._send_write(frame)
        else:
            self._send_read(frame)

    def close(self) -> None:
        """Stop using this connection; its in-flight frames go back to the channel."""
        self._fail(ClosedError("stream closed"))

    def _header(self, frame: Frame) -> memoryview:
        frame.frame_id = self.transport.next_frame_id()
        kind = FrameKind.WRITE if frame.op is TransferOp.WRITE else FrameKind.READ
        flat: list[int] = []
        for piece in frame.sent:
            flat += (piece.remote_region, piece.remote_offset, piece.length)
        head = wire.HEADER.pack(kind, 0, len(frame.sent), 0, frame.frame_id)
        return memoryview(head + wire.pack_entries(flat))

    def _send_read(self, frame: Frame) -> None:
        frame.sent = pending_slices(frame.slices)
        if not frame.sent:
            return
        header = self._header(frame)
        self._register(frame)
        try:
            self.transport.datapath.sendv(self.sock, [header], self.channel.config.io_timeout)
        except OSError as exc:
            self._fail(exc)

    def _send_write(self, frame: Frame) -> None:
        pinned = pin_slices(frame.slices, self.abort)
        frame.sent = pinned
        if not pinned:
            return
        staged: list[Window] = []
        try:
            views, staged = self._views(pinned)
            for window in staged:
                window.load()
            header = self._header(frame)
            self._register(frame)
            self.transport.datapath.sendv(
                self.sock, [header, *views], self.channel.config.io_timeout
            )
        except OSError as exc:
            self._fail(exc)
        except KVConnectError as exc:  # staging failed: the frame cannot be sent at all
            self._drop(frame)
            fail_frames([frame], exc)
        finally:
            close_all(staged)
            unpin_slices(pinned, self.abort)

    def _register(self, frame: Frame) -> None:
        """Put ``frame`` in flight (before its first byte goes out); the receiver thread is
        woken for it unless the sending thread reads its response itself."""
        with self._cond:
            self._inflight.append(frame)
            if self._inline is not frame:
                self._cond.notify_all()

    def _views(self, pieces: list[Slice]) -> tuple[list[memoryview], list[Window]]:
        entries = ((p.local, p.local_offset, p.length) for p in pieces)
        return host_views(entries, self.transport.staging)

    def _drop(self, frame: Frame) -> None:
        with self._cond:
            if frame in self._inflight:
                self._inflight.remove(frame)
                self._cond.notify_all()

    def _fail(self, cause: BaseException) -> None:
        with self._cond:
            if self.broken:
                return
            self.broken = True
            frames = list(self._inflight)
            self._inflight.clear()
            self._cond.notify_all()
        self.abort()
        log.debug("TCP stream to %s broke: %s", self.channel.peer.name, cause)
        self.channel.requeue(frames, cause)

    # ------------------------------------------------------------------------ receive side

    def _receive_loop(self) -> None:
        header = bytearray(wire.HEADER.size)
        while True:
            with self._cond:
                while (not self._inflight or self._inline is not None) and not self.broken:
                    self._cond.wait()
                if self.broken:
                    return
                frame = self._inflight[0]
            try:
                status = self._receive(frame, header)
            except (OSError, KVConnectError) as exc:  # incl. staging failures: stream is unusable
                self._fail(exc)
                return
            if not self._retire(frame):
                return
            self._complete(frame, status)

    def _retire(self, frame: Frame) -> bool:
        """Take ``frame`` off the in-flight queue; False if _fail already requeued it."""
        with self._cond:
            if self.broken or not self._inflight or self._inflight[0] is not frame:
                return False
            self._inflight.popleft()
            self._cond.notify_all()
            return True

    def _receive(self, frame: Frame, header: bytearray) -> Status:
        config = self.channel.config
        self.transport.datapath.recvv(self.sock, [memoryview(header)], config.io_timeout)
        kind, status, _count, _aux, frame_id = wire.HEADER.unpack(header)
        if kind != FrameKind.RESPONSE or frame_id != frame.frame_id:
            raise ProtocolError(f"unexpected response (kind {kind}, frame {frame_id})")
        try:
            result = Status(status)
        except ValueError as exc:
            raise ProtocolError(f"unknown status {status}") from exc
        if result is Status.OK and frame.op is TransferOp.READ:
            self._receive_payload(frame.sent)
        return result

    def _receive_payload(self, pieces: list[Slice]) -> None:
        pinned = pin_slices(pieces, self.abort)
        staged: list[Window] = []
        try:
            if len(pinned) == len(pieces):
                views, staged = self._views(pieces)
            else:  # some requests ended (deadline): their bytes go to the sink
                live = {id(p) for p in pinned}
                views = []
                for piece in pieces:
                    if id(piece) in live:
                        piece_views, piece_staged = self._views([piece])
                        views += piece_views
                        staged += piece_staged
                    else:
                        views += _scratch_views(piece.length)
            self.transport.datapath.recvv(self.sock, views, self.channel.config.io_timeout)
            for window in staged:
                window.store()
        finally:
            close_all(staged)
            unpin_slices(pinned, self.abort)

    def _complete(self, frame: Frame, status: Status) -> None:
        if status is Status.OK:
            complete_slices(frame.sent)
            nbytes = sum(p.length for p in frame.sent)
            key = "bytes_read" if frame.op is TransferOp.READ else "bytes_written"
            self.transport.counters.add(ops=len(frame.sent), **{key: nbytes})
            return
        if status is Status.UNAVAILABLE and len(frame.sent) > 1:
            self.channel.resend([Frame(frame.op, [piece]) for piece in frame.sent])
            return
        error: KVConnectError
        if status is Status.UNAVAILABLE:
            error = SourceUnavailable(f"{self.channel.peer.name} cannot serve those bytes")
        elif status in _ACCESS_STATUSES:
            error = AccessDenied(f"{self.channel.peer.name} refused the access: {status.name}")
        else:
            error = TransferError(f"{self.channel.peer.name} failed the request: {status.name}")
        self.transport.counters.add(errors=len(frame.sent))
        complete_slices(frame.sent, error)


def _scratch_views(length: int) -> list[memoryview]:
    """Views of the shared sink, enough to swallow ``length`` bytes of an ended request.

    Receivers may write it concurrently: the bytes are discarded either way.
    """
    full, rest = divmod(length, _SCRATCH.nbytes)
    return [_SCRATCH] * full + ([_SCRATCH[:rest]] if rest else [])


def _build(context: TransportContext) -> TcpTransport:
    return TcpTransport(context.config, context.datapath, context.staging, context.on_lost)


ENTRY = TransportEntry(TcpTransport.name, _build)
