"""What a same-host peer can do with the shared-memory fds a listener hands out."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import socket
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvconnect.errors import AccessDenied, AuthenticationError
from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import (
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    TransferStatus,
)
from kvconnect.transfer.memory import SHM_HEADER
from kvconnect.transfer.metadata import P2PMetadata
from kvconnect.transfer.protocol import wire
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

MiB = 1 << 20


def _errno(call: Callable[[], object]) -> int | None:
    """The errno ``call`` fails with (None if it succeeds)."""
    try:
        call()
    except OSError as exc:
        return exc.errno
    return None


def _shm_endpoint(peer: PeerProcess, token: str | None) -> str:
    return P2PMetadata(token).lookup(peer.name, 5).endpoints["shm"]


def _fetch_fd(peer: PeerProcess, region: int, token: str | None) -> int:
    """Ask the peer's Unix socket for a region's fd, as the shm transport does."""
    sock, _engine_id = wire.open_connection(_shm_endpoint(peer, token), token, 5)
    with sock:
        reply, fds = wire.control_call(sock, wire.GetRegionFd(region), wire.deadline_after(5))
    assert isinstance(reply, wire.RegionFdReply), reply
    assert len(fds) == 1
    return fds[0]


@pytest.fixture
def readonly_peer() -> Iterator[PeerProcess]:
    config = TransferConfig.from_env()
    with PeerProcess(
        config={"token": config.token}, shared=MiB, shared_writable=False, seed=5
    ) as peer:
        yield peer


def test_a_read_only_region_is_shared_with_a_read_only_fd(readonly_peer: PeerProcess) -> None:
    token = TransferConfig.from_env().token
    fd = _fetch_fd(readonly_peer, readonly_peer.regions["shared"], token)
    try:
        size = os.fstat(fd).st_size
        with pytest.raises(PermissionError):
            mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        assert _errno(lambda: os.pwrite(fd, b"x", SHM_HEADER)) == errno.EBADF
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # the inode is still sealed
        try:
            assert _errno(lambda: os.pwrite(reopened, b"x", SHM_HEADER)) == errno.EPERM
            assert _errno(lambda: os.ftruncate(reopened, 0)) == errno.EPERM  # nor resized
            with pytest.raises(PermissionError):
                mmap.mmap(reopened, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(reopened)
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mapped:
            assert mapped[SHM_HEADER : SHM_HEADER + MiB] == pattern(5, MiB).tobytes()
    finally:
        os.close(fd)
    assert readonly_peer.sha256("shared", 0, MiB) == hashlib.sha256(pattern(5, MiB)).hexdigest()


@pytest.mark.parametrize("native", ["on", "off"])
def test_shm_reads_a_read_only_region_and_refuses_writes(
    readonly_peer: PeerProcess, native: str
) -> None:
    config = TransferConfig.from_env(transport="shm", native=native)
    with TransferEngine(config) as engine:
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        region = readonly_peer.regions["shared"]
        engine.read(local, 0, readonly_peer.name, region, 0, MiB)
        assert local.view == pattern(5, MiB).data
        request = TransferRequest(local, 0, readonly_peer.name, region, 0, MiB)
        batch = engine.submit(TransferOp.WRITE, [request], timeout=10)
        assert batch.wait() == (TransferStatus.FAILED,)
        assert isinstance(batch.errors[0], AccessDenied)
    assert readonly_peer.sha256("shared", 0, MiB) == hashlib.sha256(pattern(5, MiB)).hexdigest()


def test_a_writable_region_cannot_be_resized_by_a_peer() -> None:
    token = TransferConfig.from_env().token
    with PeerProcess(config={"token": token}, shared=MiB, seed=6) as peer:
        fd = _fetch_fd(peer, peer.regions["shared"], token)
        try:
            reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:  # a shrink would crash the owner at its next access
                assert _errno(lambda: os.ftruncate(reopened, 0)) == errno.EPERM
            finally:
                os.close(reopened)
        finally:
            os.close(fd)
        assert peer.sha256("shared", 0, MiB) == hashlib.sha256(pattern(6, MiB)).hexdigest()


def test_with_a_token_the_fd_server_gives_nothing_without_the_proof() -> None:
    with PeerProcess(config={"token": "s3cret"}, shared=MiB) as peer:
        endpoint = _shm_endpoint(peer, "s3cret")
        for token in (None, "wrong"):
            with pytest.raises(AuthenticationError):
                wire.open_connection(endpoint, token, 5)
        # A client that skips the proof and asks for the fd at once gets a refusal, no fd.
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with sock:
            sock.settimeout(10)
            sock.connect("\0" + endpoint[1:])
            sock.sendall(wire.HELLO.pack(wire.MAGIC, wire.PROTOCOL_VERSION, 0, bytes(16)))
            wire.recv_exact(sock, wire.SERVER_HELLO.size)
            payload = wire.encode_control(wire.GetRegionFd(peer.regions["shared"]))
            frame = wire.HEADER.pack(wire.FrameKind.CONTROL, 0, 0, len(payload), 1) + payload
            sock.sendall(frame + bytes(max(0, wire.MAC_LEN - len(frame))))
            received = b""
            data = b"-"
            while data:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(sock, 4096, 4)
                except ConnectionResetError:  # closed with our surplus bytes unread
                    break
                assert fds == [], "the fd server handed out an fd without the token proof"
                received += data
        assert received in (b"", b"\x01")  # at most "proof refused"; then it is closed
        wait_for(lambda: peer.call({"cmd": "stats"})["auth_failures"] >= 2, "not counted")
