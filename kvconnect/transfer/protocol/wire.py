"""The peer protocol: connection handshake (version + optional HMAC proof), frames, control calls.

Every connection to a listener starts with::

    client -> HELLO        magic "KVCX", protocol version, flags, 16-byte client nonce
    server -> SERVER_HELLO magic, version, flags (bit 0: token required), server nonce, engine id
    [token] client -> HMAC(token, "client" | server nonce | client nonce)
            server -> status byte (0 ok) + HMAC(token, "server" | client nonce | server nonce)

so both sides prove the token without sending it. One deadline bounds the whole exchange on
each side (``connect_timeout``), not each read: a peer that drips bytes cannot stretch it. Then
frames follow, each a 16-byte header
(kind, status, entry count, aux, frame id). READ/WRITE frames carry ``count`` entries of
(region id, offset, length) and, for WRITE, the payload; responses come back in order, a READ
response followed by its payload. CONTROL frames carry a msgpack message of ``aux`` bytes.
All integers are little-endian.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from kvconnect.errors import AuthenticationError, PeerUnreachable, ProtocolError

PROTOCOL_VERSION: Final = 1
MAGIC: Final = b"KVCX"
FLAG_TOKEN: Final = 1
NONCE_LEN: Final = 16
MAC_LEN: Final = 32
MAX_ENTRIES: Final = 1024
MAX_CONTROL_BYTES: Final = 1 << 20
SMALL_FRAME_BYTES: Final = 64 << 10
"""A frame carrying at most this many bytes is small: its answer is due within microseconds,
so the threads on both ends poll for what comes next instead of sleeping (a bulk frame's
milliseconds of payload make a wake-up negligible)."""

HELLO: Final = struct.Struct("<4sHH16s")
SERVER_HELLO: Final = struct.Struct("<4sHH16s16s")
HEADER: Final = struct.Struct("<BBHIQ")  # kind, status, count, aux, frame id
ENTRY: Final = struct.Struct("<QQQ")  # region id, offset, length


class FrameKind(enum.IntEnum):
    """Frame types."""

    READ = 1
    WRITE = 2
    CONTROL = 3
    RESPONSE = 4


class Status(enum.IntEnum):
    """Response statuses; 1..3 equal :class:`~kvconnect.transfer.memory.Access` codes."""

    OK = 0
    UNKNOWN_REGION = 1
    OUT_OF_BOUNDS = 2
    READ_ONLY = 3
    BAD_REQUEST = 4
    INTERNAL = 5
    UNAVAILABLE = 6
    """A FILE region's source could not produce the bytes of an entry (no payload follows)."""


_ENTRY_STRUCTS: dict[int, struct.Struct] = {}


def _entries_struct(count: int) -> struct.Struct:
    packer = _ENTRY_STRUCTS.get(count)
    if packer is None:
        packer = _ENTRY_STRUCTS.setdefault(count, struct.Struct(f"<{3 * count}Q"))
    return packer


def pack_entries(flat: list[int]) -> bytes:
    """Pack (region, offset, length) triples given flat."""
    return _entries_struct(len(flat) // 3).pack(*flat)


def unpack_entries(data: bytes, count: int) -> tuple[int, ...]:
    """Inverse of :func:`pack_entries`: a flat tuple of 3 * count integers."""
    return _entries_struct(count).unpack(data)


# ---------------------------------------------------------------------------------- control


class GetSegment(msgspec.Struct, tag="get_segment"):
    """Ask for the listener's segment descriptor."""


class GetRegionFd(msgspec.Struct, tag="get_region_fd"):
    """Ask for the memfd of a shared region (Unix-socket connections only)."""

    region_id: int


class SegmentReply(msgspec.Struct, tag="segment"):
    """Encoded :class:`~kvconnect.transfer.segment.SegmentDescriptor`."""

    descriptor: bytes


class RegionFdReply(msgspec.Struct, tag="region_fd"):
    """The region's fd travels with this message as SCM_RIGHTS ancillary data."""

    region_id: int
    length: int


RDMA_VERSION: Final = 1


class RdmaPath(msgspec.Struct, frozen=True, array_like=True):
    """One end of an RC queue pair: what the other end needs to move it to RTR."""

    slot: int
    """Which of the initiator's queue pairs to this peer (a reconnect replaces the slot's)."""
    nic: str
    peer_nic: str
    gid: bytes
    qpn: int
    psn: int
    mtu: int
    """Active path MTU of the port (verbs enum value); both ends use the smaller."""


class RdmaKey(msgspec.Struct, frozen=True, array_like=True):
    """Remote access to one region through one NIC."""

    region_id: int
    nic: str
    address: int
    rkey: int


class RdmaConnect(msgspec.Struct, tag="rdma_connect"):
    """Connect queue pairs (``paths``, maybe none) and fetch keys of ``regions``; or, with
    ``release``, drop every queue pair kept for ``engine_id`` (it is closing)."""

    version: int
    engine_id: str
    paths: list[RdmaPath]
    regions: list[int]
    release: bool = False


class RdmaAccept(msgspec.Struct, tag="rdma_accept"):
    """The responder's ends of the requested paths (already in RTS) and the region keys it has
    (unknown regions are simply absent)."""

    paths: list[RdmaPath]
    keys: list[RdmaKey]


class ErrorReply(msgspec.Struct, tag="error"):
    """A refused control request."""

    status: int
    message: str


ControlRequest = GetSegment | GetRegionFd | RdmaConnect
ControlReply = SegmentReply | RegionFdReply | RdmaAccept | ErrorReply

_control_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ControlRequest)
_reply_decoder = msgspec.msgpack.Decoder(ControlReply)


def encode_control(message: ControlRequest | ControlReply) -> bytes:
    """msgpack bytes of a control message."""
    return _control_encoder.encode(message)


def decode_request(data: bytes) -> ControlRequest:
    """Parse a control request; ProtocolError on anything else."""
    try:
        return _request_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed control request: {exc}") from exc


def decode_reply(data: bytes) -> ControlReply:
    """Parse a control reply; ProtocolError on anything else."""
    try:
        return _reply_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed control reply: {exc}") from exc


# ------------------------------------------------------------------------------ byte helpers


def deadline_after(timeout: float) -> float:
    """The ``time.monotonic()`` instant ``timeout`` seconds from now."""
    return time.monotonic() + timeout


def until(sock: socket.socket, deadline: float) -> None:
    """Let the next blocking call on ``sock`` run until ``deadline`` at most.

    Raises TimeoutError once it has passed. ``sendall`` honours this as a total bound (the
    timeout is not reset by progress); reads must call it before each ``recv``.
    """
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(remaining)


def recv_exact(sock: socket.socket, size: int, deadline: float | None = None) -> bytes:
    """Read exactly ``size`` bytes, all of them by ``deadline`` (a ``time.monotonic()``
    instant; TimeoutError after it). Without one, the socket's timeout applies per call."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        if deadline is not None:
            until(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("peer closed the connection")
        got += n
    return bytes(buf)


# --------------------------------------------------------------------------------- handshake


def token_mac(token: str, label: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 keyed by the token over ``label | first | second`` (proofs, session keys)."""
    return hmac.new(token.encode(), label + first + second, hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Handshake:
    """What a finished client handshake learned: the server's id and both nonces (from which
    a caller may derive session keys)."""

    peer_id: bytes
    client_nonce: bytes
    server_nonce: bytes


def client_handshake(
    sock: socket.socket,
    token: str | None,
    deadline: float,
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
) -> Handshake:
    """Run the client side of the handshake, all of it by ``deadline`` (``time.monotonic()``;
    TimeoutError after it). ``magic``/``version`` name the protocol spoken after it (another
    server, e.g. the store master's, uses this handshake with its own)."""
    nonce = os.urandom(NONCE_LEN)
    until(sock, deadline)
    sock.sendall(HELLO.pack(magic, version, FLAG_TOKEN if token else 0, nonce))
    their_magic, their_version, flags, server_nonce, peer_id = SERVER_HELLO.unpack(
        recv_exact(sock, SERVER_HELLO.size, deadline)
    )
    if their_magic != magic:
        raise ProtocolError(f"peer is not a kvconnect listener (no {magic.decode()} greeting)")
    if their_version != version:
        raise ProtocolError(f"peer speaks protocol {their_version}, this client {version}")
    wants_token = bool(flags & FLAG_TOKEN)
    if wants_token and not token:
        raise AuthenticationError("peer requires a cluster token and none is configured")
    if token and not wants_token:
        raise AuthenticationError("a cluster token is configured but the peer does not use one")
    if token:
        until(sock, deadline)
        sock.sendall(token_mac(token, b"client", server_nonce, nonce))
        reply = recv_exact(sock, 1, deadline)
        if reply != b"\x00":
            raise AuthenticationError("peer rejected our cluster token")
        proof = recv_exact(sock, MAC_LEN, deadline)
        if not hmac.compare_digest(proof, token_mac(token, b"server", nonce, server_nonce)):
            raise AuthenticationError("peer failed to prove the cluster token")
    return Handshake(bytes(peer_id), nonce, bytes(server_nonce))


def server_handshake(
    sock: socket.socket,
    token: str | None,
    engine_id: bytes,
    deadline: float,
    also: Sequence[str] = (),
) -> None:
    """Run the server side, all of it by ``deadline`` (``time.monotonic()``; TimeoutError
    after it); raises ProtocolError/AuthenticationError (caller closes). With a ``token``, a
    client may prove it or any of ``also`` (e.g. tenants' tokens)."""
    magic, version, _flags, client_nonce = HELLO.unpack(recv_exact(sock, HELLO.size, deadline))
    if magic != MAGIC:
        raise ProtocolError("not a kvconnect client")
    nonce = os.urandom(NONCE_LEN)
    until(sock, deadline)
    sock.sendall(
        SERVER_HELLO.pack(MAGIC, PROTOCOL_VERSION, FLAG_TOKEN if token else 0, nonce, engine_id)
    )
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"client speaks protocol {version}, this engine {PROTOCOL_VERSION}")
    if not token:
        return
    proof = recv_exact(sock, MAC_LEN, deadline)
    until(sock, deadline)
    proved = proven(proof, (token, *also), b"client", nonce, client_nonce)
    if proved is None:
        sock.sendall(b"\x01")
        raise AuthenticationError("client failed to prove the cluster token")
    sock.sendall(b"\x00" + token_mac(proved, b"server", client_nonce, nonce))


def proven(
    proof: bytes, tokens: Sequence[str], label: bytes, first: bytes, second: bytes
) -> str | None:
    """The token of ``tokens`` whose MAC ``proof`` is (each compared in constant time), or
    None."""
    found = None
    for token in tokens:
        if hmac.compare_digest(proof, token_mac(token, label, first, second)):
            found = token
    return found


# ------------------------------------------------------------------------------ connections


def shutdown_quietly(sock: socket.socket) -> None:
    """Shut both directions down, waking threads blocked on ``sock``; errors are irrelevant."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def parse_tcp_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[addr]:port``) to a socket address."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ProtocolError(f"bad TCP endpoint {endpoint!r}; expected host:port")
    return host.strip("[]"), int(port)


def open_connection(
    endpoint: str,
    token: str | None,
    timeout: float,
    opened: Callable[[socket.socket], None] | None = None,
) -> tuple[socket.socket, bytes]:
    """Connect to a listener endpoint (``host:port`` or ``@abstract-unix-name``) and handshake,
    both within ``timeout`` seconds in all.

    Returns the socket (timeout set to ``timeout``) and the server's engine id. Raises
    PeerUnreachable when nothing answers in time, ProtocolError/AuthenticationError on a bad
    handshake. ``opened`` gets the socket before the handshake: shutting it down then ends a
    handshake with a peer that accepted but does not answer (a stopped process) at once.
    """
    deadline = deadline_after(timeout)
    try:
        if endpoint.startswith("@"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: str | tuple[str, int] = "\0" + endpoint[1:]
        else:
            address = parse_tcp_endpoint(endpoint)
            sock = socket.create_connection(address, timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as exc:
        raise PeerUnreachable(f"cannot connect to {endpoint}: {exc}") from exc
    try:
        if opened is not None:
            opened(sock)
        if sock.family == socket.AF_UNIX:
            until(sock, deadline)
            sock.connect(address)
        engine_id = client_handshake(sock, token, deadline).peer_id
        sock.settimeout(timeout)
    except OSError as exc:
        sock.close()
        raise PeerUnreachable(f"handshake with {endpoint} failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock, engine_id


def interrupt(sock: socket.socket) -> None:
    """Wake a thread blocked on ``sock`` (its call then fails): shut both directions down;
    nothing if the socket is closed already. Safe from any thread."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def control_call(
    sock: socket.socket, request: ControlRequest, deadline: float, frame_id: int = 0
) -> tuple[ControlReply, list[int]]:
    """Send one control request on a handshaken connection and read the reply, all by
    ``deadline`` (``time.monotonic()``; TimeoutError after); returns the reply and passed fds."""
    payload = encode_control(request)
    until(sock, deadline)
    sock.sendall(HEADER.pack(FrameKind.CONTROL, 0, 0, len(payload), frame_id) + payload)
    fds: list[int] = []
    try:
        if sock.family == socket.AF_UNIX:
            until(sock, deadline)
            data, fds, _flags, _addr = socket.recv_fds(sock, HEADER.size, 4)
            if not data:
                raise ConnectionResetError("peer closed the connection")
            header = data + recv_exact(sock, HEADER.size - len(data), deadline)
        else:
            header = recv_exact(sock, HEADER.size, deadline)
        kind, _status, _count, size, _frame = HEADER.unpack(header)
        if kind != FrameKind.RESPONSE or size > MAX_CONTROL_BYTES:
            raise ProtocolError("malformed control response")
        return decode_reply(recv_exact(sock, size, deadline)), fds
    except BaseException:
        for fd in fds:  # received descriptors are ours to close until returned
            os.close(fd)
        raise
