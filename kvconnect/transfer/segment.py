"""Segment descriptors: what an engine publishes about itself (versioned msgspec schema).

A descriptor names the engine's segment, says how to reach it (one endpoint per transport), who it
is (engine, process and host identities, used to pick same-process or same-host transports) and
which regions it serves (ids and lengths only: peers address regions by id and offset, never by
raw pointer).
"""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
from functools import cache
from typing import Final

import msgspec

from kvconnect.errors import ProtocolError

DESCRIPTOR_VERSION: Final = 1


class RegionInfo(msgspec.Struct, frozen=True, array_like=True):
    """One registered region as peers see it."""

    id: int
    length: int
    kind: str
    writable: bool
    shareable: bool


class SegmentDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a peer needs to reach an engine's segment."""

    version: int = DESCRIPTOR_VERSION
    name: str
    engine_id: str
    process_id: str
    host_id: str
    endpoints: dict[str, str]
    regions: tuple[RegionInfo, ...] = ()

    def region(self, region_id: int) -> RegionInfo | None:
        """The region with ``region_id``, or None."""
        for info in self.regions:
            if info.id == region_id:
                return info
        return None


class _Versioned(msgspec.Struct):
    version: int


_encoder = msgspec.msgpack.Encoder()
_version_decoder = msgspec.msgpack.Decoder(_Versioned)
_decoder = msgspec.msgpack.Decoder(SegmentDescriptor)


def encode_descriptor(descriptor: SegmentDescriptor) -> bytes:
    """Wire form of a descriptor."""
    return _encoder.encode(descriptor)


def decode_descriptor(data: bytes) -> SegmentDescriptor:
    """Parse a descriptor; ProtocolError on garbage or another schema version."""
    try:
        version = _version_decoder.decode(data).version
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed segment descriptor: {exc}") from exc
    if version != DESCRIPTOR_VERSION:
        raise ProtocolError(
            f"segment descriptor version {version} is not supported (this is {DESCRIPTOR_VERSION})"
        )
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed segment descriptor: {exc}") from exc


@cache
def host_identity() -> str:
    """Equal for engines that can share memory and abstract Unix sockets.

    Machine and boot identity plus the network namespace: abstract Unix sockets are scoped by
    network namespace, so engines in different namespaces (containers, test hosts) talk TCP.
    """
    parts = [socket.gethostname()]
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path, encoding="ascii") as handle:
                parts.append(handle.read().strip())
        except OSError:
            parts.append("")
    try:
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        parts.append("")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


_PROCESS_TOKEN: Final = uuid.uuid4().hex


def process_identity() -> str:
    """Equal only within one process (pid reuse cannot collide: a random token is included)."""
    return f"{host_identity()}:{os.getpid()}:{_PROCESS_TOKEN}"
