"""Request/reply plumbing over the master channel (:mod:`kvconnect.store.channel`).

The server is one thread with one event loop: it answers requests in arrival order and runs
background work between rounds in bounded steps, so state needs no locks. Whatever one
message holds, it costs only that message: a message that cannot be decoded or answered is
dropped and counted, and a frame over ``max_message_bytes`` (or one that fails to open)
disconnects its sender. Connections still in their handshake are bounded in number and time,
so idle or dripping sockets cannot crowd out clients. A client keeps its idle connections in
a small pool that any thread takes from (threads come and go: a connection per thread would
leak one per thread and make every new thread's first call pay for the handshake); a call
waits at most its timeout, and a call that times out closes its connection, so no late reply
can be mistaken for the next call's.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec

from kvconnect._throttle import Throttle
from kvconnect.errors import (
    AuthenticationError,
    ClosedError,
    CoordinationUnavailable,
    MasterUnavailable,
    ProtocolError,
)
from kvconnect.etcd import Etcd
from kvconnect.store import messages as m
from kvconnect.store.channel import (
    ClientChannel,
    Phase,
    ServerSession,
    format_endpoint,
    parse_endpoint,
    sealed_frame_limit,
)
from kvconnect.transfer.datapath import polling

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_head_decoder = msgspec.msgpack.Decoder(m.Head)
_request_decoder = msgspec.msgpack.Decoder(m.Envelope)
_reply_decoder = msgspec.msgpack.Decoder(m.ReplyEnvelope)

Handler = Callable[[m.Request, str | None], m.Reply]
"""Answers a request of a client that proved to be the tenant named (None: the cluster)."""
LEADER_KEY = "/kvconnect/master/leader"  # value: the HA leader's endpoint (see master/ha.py)
ROUND_ANSWERS = 1024  # answers between two ticks: a flood cannot starve background work
_TURN = 64  # answers to one connection before the next one's turn
_ACCEPTS = 64  # connections accepted per round
_MAX_HANDSHAKES = 256  # connections in their handshake at once (the oldest goes first)
_HANDSHAKE_SECONDS = 5.0  # the whole handshake, however the bytes drip
_READ = 1 << 18  # bytes read from one connection per round
_OUTPUT_HIGH = 1 << 20  # a connection whose replies pile up is not read until they drain
_REPLY_LIMIT = 1 << 30  # the largest reply a client accepts
_RETRY = 0.05  # between connection attempts to a master that refuses them
_IDLE_CONNECTIONS = 8  # a client's idle connections kept for its next calls (LIFO)


@dataclass(eq=False, slots=True)
class _Connection:
    sock: socket.socket
    session: ServerSession
    opened: float
    inbox: deque[bytes] = field(default_factory=deque)
    output: bytearray = field(default_factory=bytearray)
    writing: bool = False


class RpcServer:
    """Serves ``handler`` on a TCP listener; ``tick`` runs between rounds (background work)."""

    def __init__(
        self,
        endpoint: str,
        handler: Handler,
        tick: Callable[[], float],
        *,
        token: str | None,
        max_message_bytes: int,
        poll_window: float = 0.0,
        soon: Callable[[], bool] = lambda: True,
        tenants: Mapping[str, str] | None = None,
    ) -> None:
        """``tick`` returns how long (s) the loop may sleep before it wants to run again;
        ``token`` None serves unauthenticated clients; for ``poll_window`` seconds after its
        last answer the loop polls for the next request before it sleeps, unless ``soon()``
        says after that answer that no request is due that soon. ``tenants``: tenant token →
        name; requests of a connection that proved one reach ``handler`` with that name."""
        self._address = parse_endpoint(endpoint)
        self._handler = handler
        self._tick = tick
        self._token = token
        self._tenants = dict(tenants or {})
        self._max_frame = sealed_frame_limit(max_message_bytes, token)
        self._id = os.urandom(16)
        self._listener: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._connections: dict[socket.socket, _Connection] = {}
        self._handshaking: dict[socket.socket, _Connection] = {}  # oldest first
        self._ready: deque[_Connection] = deque()  # connections with requests to answer
        self._paused_until = 0.0
        self._poll_window = poll_window
        self._soon = soon
        self._answered = 0.0  # when the loop last answered a request (time.monotonic())
        self._stop = threading.Event()
        self.endpoint = ""
        self.malformed = 0
        self.refused = 0
        """Connections refused: no or a wrong cluster token, a foreign protocol, a handshake
        that did not finish in time or was crowded out."""
        self._throttle = Throttle()
        self._refusals = Throttle()
        self.crashed: BaseException | None = None

    @property
    def connections(self) -> int:
        """Open client connections, past their handshake or in it."""
        return len(self._connections)

    def bind(self) -> str:
        """Bind; returns the endpoint actually bound (resolves port 0 / ``*``)."""
        family = socket.AF_INET6 if ":" in self._address[0] else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(self._address)
            listener.listen(1024)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ)
        self.endpoint = format_endpoint(listener.getsockname())
        return self.endpoint

    def serve(self) -> None:
        """Answer requests until :meth:`stop` (from any thread). If the loop itself fails, it
        ends with the error kept in :attr:`crashed`: the process should exit."""
        try:
            while not self._stop.is_set():
                wait = self._tick()
                timeout = 0.0 if self._ready else self._poll(max(0.0, min(wait, 0.05)))
                for key, events in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept()
                        continue
                    # None: closed earlier in this round (e.g. crowded out by an accept)
                    conn = self._connections.get(key.fileobj)  # type: ignore[call-overload]
                    if conn is not None:
                        self._io(conn, events)
                self._answer_round()
                self._expire_handshakes()
                self._resume_accepting()
        except BaseException as exc:
            self.crashed = exc
            log.critical("the master's serving loop failed: %s", exc, exc_info=True)
        finally:
            for conn in list(self._connections.values()):
                self._disconnect(conn)
            if self._listener is not None:
                self._listener.close()
            self._selector.close()

    def stop(self) -> None:
        """Make :meth:`serve` return (within ~50 ms)."""
        self._stop.set()

    def _poll(self, timeout: float) -> float:
        """Within ``poll_window`` of the last answer, poll for the next event (the GIL
        released) instead of sleeping at once: a client's next request, often due within
        microseconds (a put's ``put_end`` follows its ``put_start``), then finds this thread
        awake. Returns how long the select may still sleep."""
        spin = min(timeout, self._answered + self._poll_window - time.monotonic())
        if spin <= 0:
            return timeout
        if polling.wait_readable(self._selector.fileno(), spin, spin):
            return 0.0
        return timeout - spin

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(_ACCEPTS):
            try:
                sock, _address = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: stop accepting for a moment instead of spinning on
                    # a listener that stays readable; the handshake deadline frees some.
                    log.warning("cannot accept master connections for now: %s", exc)
                    self._selector.unregister(self._listener)
                    self._paused_until = time.monotonic() + 0.1
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session = ServerSession(self._token, self._id, self._max_frame, self._tenants)
            conn = _Connection(sock, session, time.monotonic())
            self._connections[sock] = conn
            self._handshaking[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ)
            if len(self._handshaking) > _MAX_HANDSHAKES:
                self._refuse(next(iter(self._handshaking.values())), "crowded out")

    def _resume_accepting(self) -> None:
        if self._paused_until and time.monotonic() >= self._paused_until:
            self._paused_until = 0.0
            assert self._listener is not None
            self._selector.register(self._listener, selectors.EVENT_READ)

    def _expire_handshakes(self) -> None:
        cutoff = time.monotonic() - _HANDSHAKE_SECONDS
        while self._handshaking:
            oldest = next(iter(self._handshaking.values()))
            if oldest.opened > cutoff:
                return
            self._refuse(oldest, "handshake not finished in time")

    def _io(self, conn: _Connection, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
            if conn.sock not in self._connections:
                return
        readable = events & selectors.EVENT_READ
        if readable and not conn.inbox and len(conn.output) < _OUTPUT_HIGH:
            self._read(conn)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._disconnect(conn)
            return
        if not data:
            self._disconnect(conn)
            return
        try:
            messages = conn.session.receive(data)
        except AuthenticationError as exc:
            conn.output += conn.session.take_output()  # the refusal, if there is one
            self._flush(conn)
            self._refuse(conn, str(exc))
            return
        except ProtocolError as exc:
            if conn.sock in self._handshaking:
                self._refuse(conn, str(exc))
            else:
                self._dropped("a connection (%s)", exc)
                self._disconnect(conn)
            return
        if conn.sock in self._handshaking and conn.session.phase is Phase.OPEN:
            del self._handshaking[conn.sock]
        conn.output += conn.session.take_output()
        if conn.output:
            self._flush(conn)
        if messages:
            conn.inbox.extend(messages)
            self._ready.append(conn)

    def _flush(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.output)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._disconnect(conn)
            return
        del conn.output[:sent]
        wants_write = bool(conn.output)
        if wants_write != conn.writing:
            conn.writing = wants_write
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if wants_write else 0)
            self._selector.modify(conn.sock, events)

    def _disconnect(self, conn: _Connection) -> None:
        if self._connections.pop(conn.sock, None) is None:
            return
        self._handshaking.pop(conn.sock, None)
        conn.inbox.clear()
        self._selector.unregister(conn.sock)
        conn.sock.close()

    def _refuse(self, conn: _Connection, why: str) -> None:
        self.refused += 1
        if self._refusals.ready():
            log.warning("refused %d master connection(s) (last: %s)", self.refused, why)
        self._disconnect(conn)

    # ---------------------------------------------------------------------- requests

    def _answer_round(self) -> None:
        budget = ROUND_ANSWERS
        while self._ready and budget > 0:
            conn = self._ready.popleft()
            if conn.sock not in self._connections:
                continue
            for _ in range(min(_TURN, budget)):
                if not conn.inbox:
                    break
                budget -= 1
                reply = self._reply(conn.inbox.popleft(), conn.session.tenant)
                if reply is not None:
                    conn.session.send(reply)
            conn.output += conn.session.take_output()
            self._flush(conn)
            if conn.inbox and conn.sock in self._connections:
                self._ready.append(conn)
        if budget < ROUND_ANSWERS:
            self._answered = time.monotonic() if self._soon() else 0.0

    def _reply(self, payload: bytes, tenant: str | None) -> bytes | None:
        try:
            return self._answer(payload, tenant)
        except Exception as exc:  # e.g. RecursionError decoding hostile nesting
            self._dropped("a message that could not be answered (%r)", exc)
            return None

    def _dropped(self, what: str, *args: object) -> None:
        self.malformed += 1
        if self._throttle.ready():
            log.warning("dropped %s (%d dropped so far)", what % args, self.malformed)

    def _answer(self, payload: bytes, tenant: str | None) -> bytes | None:
        # The whole envelope first (one decode on the hot path); the header alone only when
        # that fails, for the request id and version to answer with.
        try:
            envelope = _request_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            return self._undecodable(payload, exc)
        body: m.Reply
        if envelope.version != m.PROTOCOL_VERSION:
            body = _version_error(envelope.version)
        else:
            body = self._handle(envelope.body, tenant)
        return _encoder.encode(m.ReplyEnvelope(envelope.request_id, body))

    def _undecodable(self, payload: bytes, error: msgspec.DecodeError) -> bytes | None:
        try:
            head = _head_decoder.decode(payload)
        except msgspec.DecodeError:
            self._dropped("a message without a readable header")
            return None  # no request id to answer to
        if head.version != m.PROTOCOL_VERSION:
            body = _version_error(head.version)
        else:
            self.malformed += 1
            body = m.Error(m.Code.INVALID, f"malformed request: {error}")
        return _encoder.encode(m.ReplyEnvelope(head.request_id, body))

    def _handle(self, request: m.Request, tenant: str | None) -> m.Reply:
        try:
            return self._handler(request, tenant)
        except Exception as exc:  # one bad request must not take the master down
            log.exception("handler failed on %s", type(request).__name__)
            return m.Error(m.Code.INTERNAL, f"{type(exc).__name__}: {exc}")


def _version_error(version: int) -> m.Error:
    return m.Error(
        m.Code.VERSION, f"protocol {version} unsupported (master speaks {m.PROTOCOL_VERSION})"
    )


class RpcClient:
    """Calls the master; thread-safe (a call takes an idle connection or opens one).

    ``target`` is a ``tcp://host:port`` endpoint, or ``etcd://…``: then the current HA leader
    is looked up in etcd, and looked up again (one retry within the timeout) when the master
    it reached is gone or answers that it is not the leader.
    """

    def __init__(
        self, target: str, timeout: float, *, token: str | None, poll_window: float = 0.0
    ) -> None:
        """``token``: the cluster token (None: plain, for an insecure master);
        ``poll_window``: seconds a call polls for the reply before it sleeps
        (:mod:`kvconnect.transfer.datapath.polling`)."""
        self._target = target
        self._timeout = timeout
        self._token = token
        self._poll_window = poll_window
        self._etcd = (
            Etcd(target, timeout=min(timeout, 2.0)) if target.startswith("etcd://") else None
        )
        self._endpoint: str | None = None if self._etcd is not None else target
        self._channels: set[ClientChannel] = set()  # every open connection, idle or in a call
        self._idle: list[tuple[str, ClientChannel]] = []  # (endpoint, connection), newest last
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False

    def call(self, request: m.Request, timeout: float | None = None) -> m.Reply:
        """Send ``request`` and wait for its reply; MasterUnavailable after the timeout."""
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        endpoint = self._current()
        try:
            reply = self._call_at(endpoint, request, deadline, check_leader=True)
        except _LeaderMoved:  # halfway through, etcd named a new leader: ask it instead
            return self._call_at(self._current(), request, deadline)
        except MasterUnavailable:
            if self._etcd is None or not self._relocate(endpoint) or time.monotonic() >= deadline:
                raise
            return self._call_at(self._current(), request, deadline)
        standby = isinstance(reply, m.Error) and reply.code is m.Code.NOT_LEADER
        if standby and self._etcd is not None and self._relocate(endpoint):
            return self._call_at(self._current(), request, deadline)
        return reply

    def connect(self, timeout: float | None = None) -> None:
        """Open a connection to the master for the next call to take, unless one is idle: its
        cost (TCP, handshake) then falls outside that call's timeout. MasterUnavailable when
        none opens in time."""
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        endpoint = self._current()
        channel = self._channel(endpoint, deadline)
        if channel is None:
            raise MasterUnavailable(f"master {endpoint} is not reachable")
        self._put_back(endpoint, channel)

    def close(self) -> None:
        """Close the idle connections and fail the calls in progress (ClosedError; each
        closes its own). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = [channel for _endpoint, channel in self._idle]
            busy = self._channels.difference(idle)
            self._channels, self._idle = set(), []
        for channel in idle:
            channel.close()
        for channel in busy:
            channel.wake()
        if self._etcd is not None:
            self._etcd.close()

    def _current(self) -> str:
        endpoint = self._endpoint
        if endpoint is None:
            assert self._etcd is not None
            try:
                endpoint = find_leader(self._etcd)
            except CoordinationUnavailable as exc:
                raise MasterUnavailable(f"cannot look up the master leader: {exc}") from exc
            if endpoint is None:
                raise MasterUnavailable("no master is the leader right now")
            self._endpoint = endpoint
        return endpoint

    def _relocate(self, failed: str) -> bool:
        """Forget ``failed`` as the leader; True if etcd now names another endpoint."""
        self._endpoint = None
        try:
            return self._current() != failed
        except MasterUnavailable:
            return False

    def _call_at(
        self, endpoint: str, request: m.Request, deadline: float, *, check_leader: bool = False
    ) -> m.Reply:
        """One call at ``endpoint``. With ``check_leader`` (and etcd), halfway to the deadline
        without an answer etcd is asked whether the leader moved (then ``_LeaderMoved``): a
        dead leader costs half the budget, not all of it. The request is never sent twice to
        one master (it may have acted on the first)."""
        check: float | None = None
        if check_leader and self._etcd is not None:
            check = time.monotonic() + (deadline - time.monotonic()) / 2
        channel = self._channel(endpoint, deadline if check is None else check)
        if channel is None and check is not None:  # not connected halfway: did the leader move?
            check = None
            self._check_leader(endpoint)
            channel = self._channel(endpoint, deadline)
        if channel is None:
            raise MasterUnavailable(f"master {endpoint} is not reachable")
        request_id = next(self._ids)
        payload = _encoder.encode(m.Envelope(m.PROTOCOL_VERSION, request_id, request))
        what = type(request).__name__
        try:
            channel.send(payload, deadline)
            while True:
                try:
                    data = channel.receive(deadline if check is None else check)
                except TimeoutError:
                    if check is None:
                        raise
                    check = None
                    self._check_leader(endpoint)  # may raise _LeaderMoved
                    continue
                reply = _reply_decoder.decode(data)
                if reply.request_id != request_id:
                    raise ProtocolError(f"a reply to request {reply.request_id}")
                self._put_back(endpoint, channel)
                return reply.body
        except TimeoutError:
            self._drop(channel)
            raise MasterUnavailable(f"master {endpoint} did not answer {what} in time") from None
        except _LeaderMoved:
            self._drop(channel)
            raise
        except (OSError, ProtocolError, msgspec.DecodeError) as exc:
            self._drop(channel)
            if self._closed:
                raise ClosedError("store client is closed") from exc
            raise MasterUnavailable(f"master {endpoint} failed during {what}: {exc}") from exc

    def _channel(self, endpoint: str, deadline: float) -> ClientChannel | None:
        """An idle connection to ``endpoint`` (now this caller's), or a new one, connecting
        (and retrying while nothing accepts) until ``deadline``: None if none by then."""
        while (channel := self._take_idle(endpoint)) is not None:
            if not channel.stale():
                return channel
            self._drop(channel)  # the master ended it while it was idle (e.g. a restart)
        while True:
            self._ensure_open()
            try:
                channel = ClientChannel.connect(
                    endpoint, self._token, deadline, _REPLY_LIMIT, self._poll_window
                )
                break
            except AuthenticationError as exc:
                raise MasterUnavailable(
                    f"master {endpoint} and this client disagree on the cluster token: {exc}"
                ) from exc
            except ProtocolError as exc:
                raise MasterUnavailable(f"{endpoint} is not a usable master: {exc}") from exc
            except OSError:  # refused, reset, or timed out: retry until the deadline
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                time.sleep(min(_RETRY, remaining))
        with self._lock:
            if self._closed:
                channel.close()
                raise ClosedError("store client is closed")
            self._channels.add(channel)
        return channel

    def _take_idle(self, endpoint: str) -> ClientChannel | None:
        """The newest idle connection to ``endpoint``; idle ones to another endpoint (a
        former leader) are closed on the way."""
        stale: list[ClientChannel] = []
        found: ClientChannel | None = None
        with self._lock:
            self._ensure_open()
            while self._idle and found is None:
                at, channel = self._idle.pop()
                if at == endpoint:
                    found = channel
                else:
                    stale.append(channel)
        for channel in stale:
            self._drop(channel)
        return found

    def _put_back(self, endpoint: str, channel: ClientChannel) -> None:
        """Keep a connection whose call ended cleanly for the next call (closed past
        :data:`_IDLE_CONNECTIONS`, or once the client is closed)."""
        with self._lock:
            if channel in self._channels and len(self._idle) < _IDLE_CONNECTIONS:
                self._idle.append((endpoint, channel))
                return
        self._drop(channel)

    def _ensure_open(self) -> None:
        if self._closed:
            raise ClosedError("store client is closed")

    def _drop(self, channel: ClientChannel) -> None:
        with self._lock:
            self._channels.discard(channel)
        channel.close()

    def _check_leader(self, endpoint: str) -> None:
        """Raise ``_LeaderMoved`` if etcd names a leader other than ``endpoint`` (a lookup that
        fails changes nothing: keep waiting for ``endpoint``)."""
        assert self._etcd is not None
        try:
            leader = find_leader(self._etcd)
        except CoordinationUnavailable:
            return
        if leader is not None and leader != endpoint:
            self._endpoint = leader
            raise _LeaderMoved(leader)


class _LeaderMoved(Exception):
    """etcd names another leader while a call waits (internal to RpcClient.call)."""


def find_leader(etcd: Etcd) -> str | None:
    """The current HA leader's endpoint, or None while there is none."""
    value, _term = etcd.get(LEADER_KEY)
    return value.decode() if value is not None else None
