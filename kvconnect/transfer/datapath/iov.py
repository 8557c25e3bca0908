"""Vectored socket I/O and copies: the C extension when built, pure Python otherwise.

Both implementations have the same contract, so every test runs against both:

- ``sendv(sock, buffers, timeout)`` sends every byte of every buffer, in order.
- ``recvv(sock, buffers, timeout)`` fills every buffer, in order; a closed peer raises
  ConnectionResetError.
- ``copy_many(dsts, srcs)`` copies each ``srcs[i]`` into the equal-length ``dsts[i]``.

``timeout`` is a stall timeout (no byte moved for that long raises TimeoutError). Buffers are
1-D, C-contiguous byte buffers (memoryviews of registered regions); the caller keeps them alive.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Final, Protocol

from kvconnect.errors import ConfigError
from kvconnect.transfer.config import NativeMode

_MAX_IOV: Final = 1000


class DataPath(Protocol):
    """The three data-path primitives; see the module docstring."""

    name: str

    def sendv(self, sock: socket.socket, buffers: Sequence[memoryview], timeout: float) -> None:
        """Send all of ``buffers``."""

    def recvv(self, sock: socket.socket, buffers: Sequence[memoryview], timeout: float) -> None:
        """Fill all of ``buffers``."""

    def copy_many(self, dsts: Sequence[memoryview], srcs: Sequence[memoryview]) -> None:
        """Copy each ``srcs[i]`` into ``dsts[i]`` (same lengths)."""


class PythonDataPath:
    """sendmsg/recvmsg_into loops; holds the GIL between syscalls."""

    name = "python"

    def sendv(self, sock: socket.socket, buffers: Sequence[memoryview], timeout: float) -> None:
        sock.settimeout(timeout)
        pending = [b for b in buffers if b.nbytes]
        first = 0
        while first < len(pending):
            sent = sock.sendmsg(pending[first : first + _MAX_IOV])
            first = _advance(pending, first, sent)

    def recvv(self, sock: socket.socket, buffers: Sequence[memoryview], timeout: float) -> None:
        sock.settimeout(timeout)
        pending = [b for b in buffers if b.nbytes]
        first = 0
        while first < len(pending):
            got = sock.recvmsg_into(pending[first : first + _MAX_IOV])[0]
            if got == 0:
                raise ConnectionResetError("peer closed the connection")
            first = _advance(pending, first, got)

    def copy_many(self, dsts: Sequence[memoryview], srcs: Sequence[memoryview]) -> None:
        if len(dsts) != len(srcs) or any(
            d.nbytes != s.nbytes for d, s in zip(dsts, srcs, strict=True)
        ):
            raise ValueError("copy_many: buffer counts or lengths differ")
        for dst, src in zip(dsts, srcs, strict=True):
            dst[:] = src


def _advance(pending: list[memoryview], first: int, done: int) -> int:
    """Consume ``done`` bytes from ``pending[first:]``; return the index of the first unfinished."""
    while done:
        size = pending[first].nbytes
        if done < size:
            pending[first] = pending[first][done:]
            return first
        done -= size
        first += 1
    return first


class NativeDataPath:
    """The C extension: each call releases the GIL for its whole loop."""

    name = "native"

    def __init__(self) -> None:
        from kvconnect import _native

        self._native = _native

    def sendv(self, sock: socket.socket, buffers: Sequence[memoryview], timeout: float) -> None:
        self._native.sendv(sock.fileno(), buffers, timeout)

    def recvv(self, sock: socket.socket, buffers: Sequence[memoryview], timeout: float) -> None:
        self._native.recvv(sock.fileno(), buffers, timeout)

    def copy_many(self, dsts: Sequence[memoryview], srcs: Sequence[memoryview]) -> None:
        self._native.copy_many(dsts, srcs)


def native_available() -> bool:
    """Whether the C extension was built and imports."""
    try:
        from kvconnect import _native  # noqa: F401
    except ImportError:
        return False
    return True


def select_datapath(mode: NativeMode) -> DataPath:
    """The data path for ``mode``: ``on`` requires the extension, ``off`` never uses it."""
    if mode == "off" or (mode == "auto" and not native_available()):
        return PythonDataPath()
    if not native_available():
        raise ConfigError(
            "native='on' but kvconnect._native is not built; reinstall with a C compiler "
            "(KVCONNECT_REQUIRE_NATIVE=1 pip install ...) or use native='auto'"
        )
    return NativeDataPath()
