"""Cluster-token authentication of kvconnect's zmq control planes (store master, vLLM side channel).

Both ends derive CURVE key pairs from the cluster token (HKDF-SHA256, one label per purpose
and role). A client must know the server's public key to complete the CurveZMQ handshake, and
the server's ZAP handler admits only the client key derived from the same token: only token
holders get a request through, the traffic is encrypted, and the token never crosses the wire.
Without a token (``insecure``) sockets stay plain.

Refusals are counted: handshakes that fail (a wrong token, a plain client) through a socket
monitor, ZAP denials (a right server key with a wrong client key) by the handler.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from kvconnect._throttle import Throttle

log = logging.getLogger(__name__)

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """Z85 CURVE keys of one purpose, derived from the token: both roles' pairs."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def curve_keys(token: str, purpose: str) -> CurveKeys:
    """The key pairs of ``purpose`` (e.g. ``"master"``) for ``token``; deterministic."""
    server_secret = z85.encode(_derive(token, f"kvconnect {purpose} server"))
    client_secret = z85.encode(_derive(token, f"kvconnect {purpose} client"))
    return CurveKeys(
        zmq.curve_public(server_secret),
        server_secret,
        zmq.curve_public(client_secret),
        client_secret,
    )


def _derive(token: str, label: str) -> bytes:
    # HKDF (RFC 5869) with one output block: extract with a fixed salt, expand with the label.
    prk = hmac.new(b"kvconnect-curve-v1", token.encode(), hashlib.sha256).digest()
    return hmac.new(prk, label.encode() + b"\x01", hashlib.sha256).digest()


def secure_client(sock: zmq.Socket[bytes], keys: CurveKeys | None) -> None:
    """Make ``sock`` (before connect) a CURVE client of ``keys``; plain when None."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class ServerAuth:
    """The server side of one context: its ZAP handler and a monitor of refused handshakes.

    Single-threaded: the owner polls with :meth:`poller` and passes each poll's result to
    :meth:`handle_ready`. Create it before the server socket binds, on the same context.
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys | None) -> None:
        self._keys = keys
        self.refused = 0
        self._throttle = Throttle()
        self.sockets: list[zmq.Socket[bytes]] = []
        self._zap: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        if keys is not None:
            self._zap = context.socket(zmq.REP)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind(_ZAP_ENDPOINT)
            self.sockets.append(self._zap)

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (before bind) a CURVE server that asks this handler about clients."""
        if self._keys is None:
            return
        sock.curve_server = True
        sock.curve_secretkey = self._keys.server_secret
        sock.zap_domain = b"kvconnect"
        self._monitor = sock.get_monitor_socket(_HANDSHAKE_FAILURES)
        self.sockets.append(self._monitor)

    def poller(self, server: zmq.Socket[bytes]) -> zmq.Poller:
        """A poller of ``server`` and this handler's sockets (for POLLIN)."""
        poller = zmq.Poller()
        for sock in (server, *self.sockets):
            poller.register(sock, zmq.POLLIN)
        return poller

    def handle_ready(self, ready: dict[zmq.Socket[bytes], int]) -> None:
        """Answer what is queued on this handler's sockets among ``ready`` (a poll's result)."""
        for sock in self.sockets:
            if sock in ready:
                self._handle(sock)

    def _handle(self, ready: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = ready.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if ready is self._zap:
                ready.send_multipart(self._verdict(frames))
            elif len(frames) == 2:  # a monitor event: what happened, and the address
                self._refuse("handshake failed")

    def _verdict(self, frames: list[bytes]) -> list[bytes]:
        # ZAP request: version, request id, domain, address, identity, mechanism, credentials.
        assert self._keys is not None
        if len(frames) < 7:  # libzmq never sends this; answer so the REP socket stays usable
            self._refuse("malformed ZAP request")
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"malformed", b"", b""]
        allowed = frames[5] == b"CURVE" and frames[6] == z85.decode(self._keys.client_public)
        if not allowed:
            self._refuse("unknown client key")
        status = (b"200", b"OK") if allowed else (b"400", b"unknown client key")
        return [frames[0], frames[1], *status, b"", b""]

    def _refuse(self, why: str) -> None:
        self.refused += 1
        if self._throttle.ready():
            log.warning("refused %d unauthenticated connection(s) (last: %s)", self.refused, why)

    def close(self) -> None:
        """Close the handler's sockets. Idempotent."""
        for sock in self.sockets:
            sock.close(0)
        self.sockets = []
