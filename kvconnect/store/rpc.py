"""Request/reply plumbing over zmq (ROUTER on the master, DEALER per client thread).

The server is single-threaded: it answers requests in arrival order and runs background work
between polls in bounded steps, so state needs no locks. Whatever one message holds, it costs
only that message: a message that cannot be decoded, answered or replied to is dropped and
counted, and a message over ``max_message_bytes`` disconnects its sender. With a cluster
token every connection is CURVE-authenticated (:mod:`kvconnect.auth`). Clients get one DEALER
socket per thread (zmq sockets are not thread-safe); a call waits at most its timeout, and
late replies of abandoned calls are recognized by request id and dropped.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from kvconnect._throttle import Throttle
from kvconnect.auth import ServerAuth, curve_keys, secure_client
from kvconnect.errors import ClosedError, CoordinationUnavailable, MasterUnavailable
from kvconnect.etcd import Etcd
from kvconnect.store import messages as m

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_head_decoder = msgspec.msgpack.Decoder(m.Head)
_request_decoder = msgspec.msgpack.Decoder(m.Envelope)
_reply_decoder = msgspec.msgpack.Decoder(m.ReplyEnvelope)

Handler = Callable[[m.Request], m.Reply]
LEADER_KEY = "/kvconnect/master/leader"  # value: the HA leader's endpoint (see master/ha.py)
_PURPOSE = "master"  # CURVE key derivation label (kvconnect.auth)


class RpcServer:
    """Serves ``handler`` on a ROUTER socket; ``tick`` runs between polls (background work)."""

    def __init__(
        self,
        endpoint: str,
        handler: Handler,
        tick: Callable[[], float],
        *,
        token: str | None,
        max_message_bytes: int,
    ) -> None:
        """``tick`` returns how long (s) the loop may sleep before it wants to run again;
        ``token`` None serves unauthenticated clients."""
        self._endpoint = endpoint
        self._handler = handler
        self._tick = tick
        self._context = zmq.Context()
        self._auth = ServerAuth(self._context, curve_keys(token, _PURPOSE) if token else None)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._auth.secure(self._socket)
        self._poller = self._auth.poller(self._socket)
        self._stop = threading.Event()
        self.endpoint = ""
        self.malformed = 0
        self._throttle = Throttle()
        self.crashed: BaseException | None = None

    @property
    def refused(self) -> int:
        """Connections refused for want of the cluster token."""
        return self._auth.refused

    def bind(self) -> str:
        """Bind; returns the endpoint actually bound (resolves port 0 / ``*``)."""
        self._socket.bind(self._endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    def serve(self) -> None:
        """Answer requests until :meth:`stop` (from any thread). If the loop itself fails, it
        ends with the error kept in :attr:`crashed`: the process should exit."""
        try:
            while not self._stop.is_set():
                wait = self._tick()
                ready = dict(self._poller.poll(int(max(0.0, min(wait, 0.05)) * 1000)))
                self._auth.handle_ready(ready)
                if self._socket in ready:
                    self._drain()
        except BaseException as exc:
            self.crashed = exc
            log.critical("the master's serving loop failed: %s", exc, exc_info=True)
        finally:
            self._auth.close()
            self._socket.close(0)
            self._context.term()

    def stop(self) -> None:
        """Make :meth:`serve` return (within ~50 ms)."""
        self._stop.set()

    def _drain(self) -> None:
        # Answer everything queued before doing background work again, up to a bound, so a
        # flood cannot starve the tick (leases, heartbeats, eviction) either.
        for _ in range(1024):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._dropped("a message of %d frames", len(frames))
                continue
            identity, payload = frames
            try:
                reply = self._answer(payload)
            except Exception as exc:  # e.g. RecursionError decoding hostile nesting
                self._dropped("a message that could not be answered (%r)", exc)
                continue
            if reply is not None:
                try:
                    self._socket.send_multipart([identity, reply], zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # the client stopped reading: its reply goes
                    self._dropped("a reply that could not be sent (%s)", exc)

    def _dropped(self, what: str, *args: object) -> None:
        self.malformed += 1
        if self._throttle.ready():
            log.warning("dropped %s (%d dropped so far)", what % args, self.malformed)

    def _answer(self, payload: bytes) -> bytes | None:
        try:
            head = _head_decoder.decode(payload)
        except msgspec.DecodeError:
            self._dropped("a message without a readable header")
            return None  # no request id to answer to
        if head.version != m.PROTOCOL_VERSION:
            body: m.Reply = m.Error(
                m.Code.VERSION,
                f"protocol {head.version} unsupported (master speaks {m.PROTOCOL_VERSION})",
            )
        else:
            try:
                request = _request_decoder.decode(payload).body
            except msgspec.DecodeError as exc:
                self.malformed += 1
                body = m.Error(m.Code.INVALID, f"malformed request: {exc}")
            else:
                body = self._handle(request)
        return _encoder.encode(m.ReplyEnvelope(head.request_id, body))

    def _handle(self, request: m.Request) -> m.Reply:
        try:
            return self._handler(request)
        except Exception as exc:  # one bad request must not take the master down
            log.exception("handler failed on %s", type(request).__name__)
            return m.Error(m.Code.INTERNAL, f"{type(exc).__name__}: {exc}")


class RpcClient:
    """Calls the master; thread-safe (a socket per calling thread).

    ``target`` is a zmq endpoint, or ``etcd://…``: then the current HA leader is looked up in
    etcd, and looked up again (one retry within the timeout) when the master it reached is gone
    or answers that it is not the leader.
    """

    def __init__(self, target: str, timeout: float, *, token: str | None) -> None:
        """``token``: the cluster token (None: plain, for an insecure master)."""
        self._target = target
        self._timeout = timeout
        self._keys = curve_keys(token, _PURPOSE) if token else None
        self._etcd = (
            Etcd(target, timeout=min(timeout, 2.0)) if target.startswith("etcd://") else None
        )
        self._endpoint: str | None = None if self._etcd is not None else target
        self._context = zmq.Context()
        self._local = threading.local()
        self._sockets: list[zmq.Socket[bytes]] = []
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

    def close(self) -> None:
        """Close every socket and the context. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close(0)
        self._context.term()
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
        one master (a late first answer would race the second)."""
        check: float | None = None
        if check_leader and self._etcd is not None:
            check = time.monotonic() + (deadline - time.monotonic()) / 2
        sock = self._socket(endpoint)
        request_id = next(self._ids)
        payload = _encoder.encode(m.Envelope(m.PROTOCOL_VERSION, request_id, request))
        try:
            sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            # IMMEDIATE: the socket is writable only while connected, so a dead master costs
            # the timeout here instead of a queued request that would be answered much later.
            if check is not None and not sock.poll(_ms(check), zmq.POLLOUT):
                self._check_leader(endpoint)
                check = None
            if not sock.poll(_ms(deadline), zmq.POLLOUT):
                raise MasterUnavailable(self._not_connected(endpoint)) from None
            try:
                sock.send(payload, zmq.NOBLOCK)
            except zmq.Again as exc:
                raise MasterUnavailable(self._not_connected(endpoint)) from exc
        while True:
            # A receive timeout instead of a poll: one call less per request on the hot path.
            sock.setsockopt(zmq.RCVTIMEO, max(1, _ms(deadline if check is None else check)))
            try:
                data = sock.recv()
            except zmq.Again:
                if check is not None:
                    self._check_leader(endpoint)
                    check = None
                    continue
                raise MasterUnavailable(
                    f"master {endpoint} did not answer {type(request).__name__} in time"
                ) from None
            try:
                reply = _reply_decoder.decode(data)
            except msgspec.DecodeError:
                continue  # not ours to interpret; keep waiting for our reply
            if reply.request_id == request_id:
                return reply.body
            if time.monotonic() >= deadline:
                raise MasterUnavailable(
                    f"master {endpoint} did not answer {type(request).__name__} in time"
                )

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

    def _not_connected(self, endpoint: str) -> str:
        if self._keys is None:
            return f"master {endpoint} is not connected (or it requires a cluster token)"
        return f"master {endpoint} is not connected (or it refused this client's cluster token)"

    def _socket(self, endpoint: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] | None = getattr(self._local, "socket", None)
        if sock is not None and getattr(self._local, "endpoint", None) == endpoint:
            return sock
        with self._lock:
            if self._closed:
                raise ClosedError("store client is closed")
            if sock is not None:  # the leader moved: this thread's old socket goes
                self._sockets.remove(sock)
                sock.close(0)
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            secure_client(sock, self._keys)
            sock.connect(endpoint)
            self._sockets.append(sock)
        self._local.socket = sock
        self._local.endpoint = endpoint
        return sock


class _LeaderMoved(Exception):
    """etcd names another leader while a call waits (internal to RpcClient.call)."""


def find_leader(etcd: Etcd) -> str | None:
    """The current HA leader's endpoint, or None while there is none."""
    value, _term = etcd.get(LEADER_KEY)
    return value.decode() if value is not None else None


def _ms(deadline: float) -> int:
    """Milliseconds until ``deadline`` for zmq polls (0 once passed)."""
    return max(0, int((deadline - time.monotonic()) * 1000))
