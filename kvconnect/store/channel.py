"""The store master's channel: one TCP connection per client thread, framed and sealed.

It opens with the transfer protocol's handshake (:mod:`kvconnect.transfer.protocol.wire`)
under its own magic ``KVCM``: both sides prove the cluster token without sending it. Then
each message is a frame ``u32 length (LE) | body``; with a token the body is sealed with
AES-256-GCM under a key per direction derived from the token and both handshake nonces, the
nonce being the frame's sequence number, so a frame that was altered, replayed, reordered or
taken from another connection fails to open and ends the connection. Without a token
(``insecure``) bodies are plain.

The server side is a pure state machine (:class:`ServerSession`: bytes in, messages and bytes
out) driven by the master's event loop; the client side is a blocking :class:`ClientChannel`.
Plain sockets instead of zmq: zmq hands every message through its I/O threads, which cost
~90 µs of each small round trip between two Python processes (docs/benchmarks.md).
"""

from __future__ import annotations

import enum
import os
import select
import socket
import struct
import time
from collections.abc import Mapping
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvconnect.errors import AuthenticationError, ProtocolError
from kvconnect.transfer.datapath import polling
from kvconnect.transfer.protocol import wire

MAGIC: Final = b"KVCM"
VERSION: Final = 1
LENGTH: Final = struct.Struct("<I")
TAG_LEN: Final = 16  # AES-GCM's tag, added to every sealed body
_NONCE: Final = struct.Struct("<4xQ")  # 96-bit GCM nonce: the frame's sequence number
_REFUSED: Final = b"\x01"
_ACCEPTED: Final = b"\x00"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` (``*`` for every address, ``[v6]`` for IPv6) to a socket address."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "tcp":
        raise ProtocolError(f"bad master endpoint {endpoint!r}; expected tcp://host:port")
    host, port = wire.parse_tcp_endpoint(rest)
    return ("" if host == "*" else host), port  # "": every address


def format_endpoint(address: tuple[str, int]) -> str:
    """The ``tcp://`` endpoint of a bound socket address (IPv6 bracketed)."""
    host, port = address[0], address[1]
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class _Seal:
    """One direction's sealing: AES-GCM with the sequence number as nonce, or plain."""

    def __init__(self, key: bytes | None) -> None:
        self._aead = AESGCM(key) if key is not None else None
        self._sequence = 0

    def seal(self, body: bytes) -> bytes:
        if self._aead is None:
            return body
        nonce = _NONCE.pack(self._sequence)
        self._sequence += 1
        return self._aead.encrypt(nonce, body, None)

    def open(self, body: bytes) -> bytes:
        if self._aead is None:
            return body
        nonce = _NONCE.pack(self._sequence)
        self._sequence += 1
        try:
            return self._aead.decrypt(nonce, body, None)
        except InvalidTag:
            raise ProtocolError("a frame failed authentication (altered or replayed)") from None


def _seals(token: str | None, client_nonce: bytes, server_nonce: bytes) -> tuple[_Seal, _Seal]:
    """(client→server, server→client) seals of one connection."""
    if token is None:
        return _Seal(None), _Seal(None)
    c2s = wire.token_mac(token, b"master c2s", client_nonce, server_nonce)
    s2c = wire.token_mac(token, b"master s2c", client_nonce, server_nonce)
    return _Seal(c2s), _Seal(s2c)


def frame(seal: _Seal, message: bytes) -> bytes:
    """``message`` as one frame on the wire (sealed when the connection has a token)."""
    body = seal.seal(message)
    return LENGTH.pack(len(body)) + body


class Phase(enum.Enum):
    """Where a server-side connection is."""

    HELLO = 1  # waiting for the client's HELLO
    PROOF = 2  # waiting for the client's token proof
    OPEN = 3  # exchanging frames


class ServerSession:
    """The server side of one connection, without I/O: feed what arrived to :meth:`receive`,
    write what :meth:`take_output` returns.

    ``receive`` raises AuthenticationError (the client lacks the token: a refusal is queued
    first, so the caller should still flush the output) or ProtocolError (anything else that
    ends the connection: a foreign peer, another version, a frame over ``max_frame`` or one
    that fails to open).
    """

    def __init__(
        self,
        token: str | None,
        server_id: bytes,
        max_frame: int,
        tenants: Mapping[str, str] | None = None,
    ) -> None:
        """``tenants``: tenant token → tenant name; a client proving one of them is that
        tenant (:attr:`tenant`), one proving ``token`` is none (the cluster's own)."""
        self._token = token
        self._tenants = tenants or {}
        self.tenant: str | None = None
        """The tenant the client proved to be (once open), None for the cluster token."""
        self._server_id = server_id
        self._max_frame = max_frame
        self._inbox = bytearray()
        self._output = bytearray()
        self.phase = Phase.HELLO
        self._client_nonce = b""
        self._nonce = os.urandom(wire.NONCE_LEN)
        self._seals = (_Seal(None), _Seal(None))

    def receive(self, data: bytes) -> list[bytes]:
        """Take ``data``; returns the messages it completed, in order."""
        self._inbox += data
        if self.phase is Phase.HELLO:
            self._hello()
        if self.phase is Phase.PROOF:
            self._proof()
        return self._frames() if self.phase is Phase.OPEN else []

    def send(self, message: bytes) -> None:
        """Queue ``message`` (the connection must be open)."""
        self._output += frame(self._seals[1], message)

    def take_output(self) -> bytearray:
        """Bytes to write, in order; each is returned once."""
        out, self._output = self._output, bytearray()
        return out

    def _hello(self) -> None:
        if len(self._inbox) < wire.HELLO.size:
            return
        magic, version, flags, self._client_nonce = wire.HELLO.unpack_from(self._inbox)
        del self._inbox[: wire.HELLO.size]
        if magic != MAGIC:
            raise ProtocolError("not a store master client")
        wants = wire.FLAG_TOKEN if self._token else 0
        self._output += wire.SERVER_HELLO.pack(MAGIC, VERSION, wants, self._nonce, self._server_id)
        if version != VERSION:
            raise ProtocolError(f"client speaks master protocol {version}, this master {VERSION}")
        if bool(flags & wire.FLAG_TOKEN) != bool(self._token):
            # The client ends the handshake itself on seeing our flags; this one never opens.
            raise AuthenticationError(
                "client without the cluster token" if self._token else "client with a token"
            )
        self.phase = Phase.PROOF if self._token else Phase.OPEN

    def _proof(self) -> None:
        if len(self._inbox) < wire.MAC_LEN:
            return
        assert self._token is not None
        proof = bytes(self._inbox[: wire.MAC_LEN])
        del self._inbox[: wire.MAC_LEN]
        tokens = (self._token, *self._tenants)
        proved = wire.proven(proof, tokens, b"client", self._nonce, self._client_nonce)
        if proved is None:
            self._output += _REFUSED
            raise AuthenticationError("client failed to prove the cluster token")
        server_proof = wire.token_mac(proved, b"server", self._client_nonce, self._nonce)
        self._output += _ACCEPTED + server_proof
        self._seals = _seals(proved, self._client_nonce, self._nonce)
        self.tenant = self._tenants.get(proved) if proved != self._token else None
        self.phase = Phase.OPEN

    def _frames(self) -> list[bytes]:
        messages: list[bytes] = []
        inbox = self._inbox
        start = 0
        while len(inbox) - start >= LENGTH.size:
            (size,) = LENGTH.unpack_from(inbox, start)
            if size > self._max_frame:
                raise ProtocolError(f"a frame of {size} bytes (at most {self._max_frame})")
            end = start + LENGTH.size + size
            if len(inbox) < end:
                break
            messages.append(self._seals[0].open(bytes(inbox[start + LENGTH.size : end])))
            start = end
        del inbox[:start]
        return messages


def sealed_frame_limit(max_message_bytes: int, token: str | None) -> int:
    """The largest frame body that can carry a message of ``max_message_bytes``."""
    return max_message_bytes + (TAG_LEN if token else 0)


class ClientChannel:
    """One blocking connection to a master. Not thread-safe: one per calling thread.

    Every call takes a ``deadline`` (``time.monotonic()``); TimeoutError after it, OSError
    when the connection ends, ProtocolError on a frame that does not open (after any of them
    the channel is unusable: close it). :meth:`wake` from another thread fails a call.
    A receive polls for the master's reply for ``poll_window`` seconds before it sleeps
    (:mod:`kvconnect.transfer.datapath.polling`).
    """

    def __init__(
        self,
        sock: socket.socket,
        seals: tuple[_Seal, _Seal],
        max_frame: int,
        poll_window: float = 0.0,
    ) -> None:
        self._sock = sock
        self._send_seal, self._receive_seal = seals
        self._max_frame = max_frame
        self._poll_window = poll_window
        self._buffer = bytearray()
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    @classmethod
    def connect(
        cls,
        endpoint: str,
        token: str | None,
        deadline: float,
        max_frame: int,
        poll_window: float = 0.0,
    ) -> ClientChannel:
        """Connect and handshake by ``deadline``. OSError when nothing accepts,
        AuthenticationError/ProtocolError when the server is not one this client can talk to."""
        address = parse_endpoint(endpoint)
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            raise TimeoutError("deadline passed")
        sock = socket.create_connection(address, timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            done = wire.client_handshake(sock, token, deadline, magic=MAGIC, version=VERSION)
        except BaseException:
            sock.close()
            raise
        seals = _seals(token, done.client_nonce, done.server_nonce)
        return cls(sock, seals, max_frame, poll_window)

    def send(self, message: bytes, deadline: float) -> None:
        """Send one message."""
        wire.until(self._sock, deadline)
        self._sock.sendall(frame(self._send_seal, message))

    def receive(self, deadline: float) -> bytes:
        """The next message."""
        (size,) = LENGTH.unpack(self._read(LENGTH.size, deadline))
        if size > self._max_frame:
            raise ProtocolError(f"the master sent a frame of {size} bytes")
        return self._receive_seal.open(self._read(size, deadline))

    def stale(self) -> bool:
        """Whether anything is readable between calls: the server ended this idle connection
        (e.g. it restarted) or broke the protocol. Never blocks."""
        return bool(self._poll.poll(0))

    def wake(self) -> None:
        """Make a call on this channel fail at once, whether it waits already or is about to
        (from any thread); the caller then closes it. The descriptor stays open meanwhile: a
        caller about to wait on it must never wait on a number another socket now holds."""
        wire.shutdown_quietly(self._sock)

    def close(self) -> None:
        """Release the socket (by the thread that uses it, or once none does). Idempotent."""
        wire.shutdown_quietly(self._sock)
        self._sock.close()

    def _read(self, size: int, deadline: float) -> bytes:
        buffer = self._buffer
        while len(buffer) < size:
            left = deadline - time.monotonic()
            if not polling.wait_readable(self._sock.fileno(), self._poll_window, left):
                raise TimeoutError("deadline passed")
            wire.until(self._sock, deadline)
            chunk = self._sock.recv(min(max(size - len(buffer), 1 << 16), 1 << 22))
            if not chunk:
                raise ConnectionResetError("the master closed the connection")
            buffer += chunk
        data = bytes(buffer[:size])
        del buffer[:size]
        return data
