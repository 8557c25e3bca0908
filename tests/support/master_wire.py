"""Raw sockets that speak (part of) the store master's channel by hand, for hostile tests."""

from __future__ import annotations

import os
import socket
import time

from kvconnect.store import channel as ch
from kvconnect.transfer.protocol import wire


def hostile_hello(endpoint: str, *, flags: int, partial: bool = False) -> socket.socket:
    """A connection that sent the master a HELLO with ``flags`` (all of it, or only its first
    bytes with ``partial``) and nothing else yet."""
    sock = socket.create_connection(ch.parse_endpoint(endpoint), timeout=5)
    hello = wire.HELLO.pack(ch.MAGIC, ch.VERSION, flags, os.urandom(wire.NONCE_LEN))
    sock.sendall(hello[:10] if partial else hello)
    return sock


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything ``sock`` receives until the peer closes it; AssertionError if the peer keeps
    it open past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    received = bytearray()
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"still open after {timeout} s (got {len(received)} bytes)"
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            continue
        if not chunk:
            sock.close()
            return bytes(received)
        received += chunk
