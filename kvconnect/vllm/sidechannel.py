"""The prefill engine's side channel: zmq request/reply, msgspec on the wire.

The server runs on one thread in prefill's scheduler process and answers from a handler (it
must be quick: it takes a lock on the lease table). Clients — decode's scheduler and workers —
keep one DEALER socket per (thread, endpoint); every call waits at most its timeout and
raises PeerUnreachable after it. A call that fails closes its socket: a DEALER queues what is
sent to a peer that is down and delivers it once something listens there again (a replacement
engine would get the dead one's renewals and confirmations), and blocks sending once the queue
is full; a fresh socket per failure leaves no such backlog and no stale reply. With a cluster
token both ends are CURVE-authenticated (:mod:`kvconnect.auth`); a message that cannot be
decoded or answered costs only itself.
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
from kvconnect.errors import ClosedError, PeerUnreachable, ProtocolError
from kvconnect.vllm import messages as msg

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(msg.Envelope)
_replies = msgspec.msgpack.Decoder(msg.ReplyEnvelope)
_POLL_MS = 100
_PURPOSE = "vllm side channel"  # CURVE key derivation label (kvconnect.auth)
_MAX_MESSAGE_BYTES = 16 << 20  # far above any request (block ids of one request)

Handler = Callable[[msg.Request], msg.Reply]


class SideChannelServer:
    """Answers side-channel calls with ``handler`` on a thread of its own."""

    def __init__(self, host: str, port: int, handler: Handler, *, token: str | None) -> None:
        """``token`` None serves unauthenticated callers (insecure)."""
        self._address = f"tcp://{host}:{port}"
        self._handler = handler
        self._context = zmq.Context()
        self._auth = ServerAuth(self._context, curve_keys(token, _PURPOSE) if token else None)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        self._auth.secure(self._socket)
        self._poller = self._auth.poller(self._socket)
        self._throttle = Throttle()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.port = 0
        self.malformed = 0

    def start(self) -> None:
        """Bind (port 0 picks one: see :attr:`port`) and serve."""
        self._socket.bind(self._address)
        self.port = int(self._socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._thread = threading.Thread(
            target=self._serve, name="kvconnect-vllm-side-channel", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the socket. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        else:
            self._close_sockets()
        self._context.term()

    @property
    def refused(self) -> int:
        """Connections refused for want of the cluster token."""
        return self._auth.refused

    def _close_sockets(self) -> None:
        self._auth.close()
        self._socket.close(0)

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                ready = dict(self._poller.poll(_POLL_MS))
                self._auth.handle_ready(ready)
                if self._socket in ready:
                    self._answer(self._socket.recv_multipart())
        finally:
            self._close_sockets()

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.malformed += 1
            return
        identity, payload = frames
        try:
            envelope = _requests.decode(payload)
        except Exception as exc:  # DecodeError, or RecursionError on hostile nesting
            self.malformed += 1
            if self._throttle.ready():
                log.warning("dropped %d malformed side-channel request(s): %r", self.malformed, exc)
            return
        if envelope.version != msg.PROTOCOL_VERSION:
            body: msg.Reply = msg.Ack(
                False,
                f"side-channel protocol {envelope.version} unsupported "
                f"(this engine speaks {msg.PROTOCOL_VERSION})",
            )
        else:
            try:
                body = self._handler(envelope.body)
            except Exception as exc:  # a bad request must not stop the channel
                log.exception("side-channel handler failed on %s", type(envelope.body).__name__)
                body = msg.Ack(False, f"{type(exc).__name__}: {exc}")
        reply = msg.ReplyEnvelope(msg.PROTOCOL_VERSION, envelope.call, body)
        try:
            self._socket.send_multipart([identity, _encoder.encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError:  # the caller stopped reading; its call times out on its side
            self.malformed += 1


class SideChannelClient:
    """Calls prefill side channels; thread-safe (a socket per thread and endpoint)."""

    def __init__(self, timeout: float, *, token: str | None) -> None:
        """``token``: the cluster token the prefill engines serve with (None: plain)."""
        self.timeout = timeout
        self._keys = curve_keys(token, _PURPOSE) if token else None
        self._context = zmq.Context()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._sockets: list[zmq.Socket[bytes]] = []
        self._calls = itertools.count(1)
        self._closed = False

    def call(self, endpoint: str, request: msg.Request, timeout: float | None = None) -> msg.Reply:
        """One request and its reply; PeerUnreachable when no reply comes in time."""
        sock = self._socket(endpoint)
        call = next(self._calls)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            try:
                sock.send(
                    _encoder.encode(msg.Envelope(msg.PROTOCOL_VERSION, call, request)), zmq.NOBLOCK
                )
            except zmq.Again as exc:  # only a socket that queued many unanswered calls
                raise PeerUnreachable(f"prefill side channel {endpoint} takes no calls") from exc
            return self._reply(sock, endpoint, request, call, deadline)
        except (PeerUnreachable, ProtocolError):
            self._discard(endpoint, sock)
            raise

    def _reply(
        self,
        sock: zmq.Socket[bytes],
        endpoint: str,
        request: msg.Request,
        call: int,
        deadline: float,
    ) -> msg.Reply:
        while True:
            wait = int((deadline - time.monotonic()) * 1000)
            if wait <= 0 or not sock.poll(wait, zmq.POLLIN):
                raise PeerUnreachable(
                    f"prefill side channel {endpoint} did not answer "
                    f"{type(request).__name__} in time (is its cluster token the same?)"
                )
            try:
                reply = _replies.decode(sock.recv())
            except msgspec.DecodeError as exc:
                raise ProtocolError(f"malformed reply from {endpoint}: {exc}") from exc
            if reply.call == call:  # older replies belong to calls that timed out
                return reply.body

    def open_sockets(self) -> int:
        """Sockets open now, over every thread (what a leak would grow)."""
        with self._lock:
            return len(self._sockets)

    def _discard(self, endpoint: str, sock: zmq.Socket[bytes]) -> None:
        """Close the calling thread's socket to ``endpoint`` (its next call opens a new one)."""
        sockets: dict[str, zmq.Socket[bytes]] = self._local.sockets
        if sockets.get(endpoint) is sock:
            del sockets[endpoint]
        with self._lock:
            if sock in self._sockets:  # close() may have closed it already
                self._sockets.remove(sock)
                sock.close(0)

    def release(self) -> None:
        """Close the calling thread's sockets (for a thread that ends; its next call, if
        any, opens new ones)."""
        sockets: dict[str, zmq.Socket[bytes]] | None = getattr(self._local, "sockets", None)
        if not sockets:
            return
        with self._lock:
            for sock in sockets.values():
                if sock in self._sockets:  # close() may have closed it already
                    self._sockets.remove(sock)
                    sock.close(0)
        sockets.clear()

    def close(self) -> None:
        """Close every socket. Idempotent."""
        with self._lock:
            self._closed = True
            for sock in self._sockets:
                sock.close(0)
            self._sockets.clear()
        self._context.term()

    def _socket(self, endpoint: str) -> zmq.Socket[bytes]:
        sockets: dict[str, zmq.Socket[bytes]] | None = getattr(self._local, "sockets", None)
        if sockets is None:
            sockets = self._local.sockets = {}
        sock = sockets.get(endpoint)
        if sock is not None:
            return sock
        with self._lock:
            if self._closed:
                raise ClosedError("side-channel client is closed")
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            secure_client(sock, self._keys)
            sock.connect(endpoint)
            self._sockets.append(sock)
        sockets[endpoint] = sock
        return sock
