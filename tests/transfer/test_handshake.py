"""Slow and silent clients and servers: connect_timeout bounds the whole handshake, both ends.

Real sockets throughout: the listener is a child process, the slow clients and servers are raw
sockets of this process that send a valid message one byte at a time.
"""

from __future__ import annotations

import os
import select
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvconnect.errors import PeerUnreachable
from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import (
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    TransferStatus,
)
from kvconnect.transfer.metadata import P2PMetadata
from kvconnect.transfer.protocol import wire
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

MiB = 1 << 20
DRIP = 0.2  # seconds between two bytes of a drip-fed message
HELLO = wire.HELLO.pack(wire.MAGIC, wire.PROTOCOL_VERSION, 0, os.urandom(wire.NONCE_LEN))


def _token() -> str | None:
    return TransferConfig.from_env().token


@dataclass(eq=False)
class _Drip:
    """One connection that sends ``message`` a byte every DRIP seconds."""

    sock: socket.socket
    message: bytes
    sent: int = 0
    answered: bool = False  # the server sent something back
    closed: threading.Event = field(default_factory=threading.Event)


def _connect(endpoint: str) -> socket.socket:
    """A raw connection to a listener's TCP (``host:port``) or Unix (``@name``) endpoint."""
    if not endpoint.startswith("@"):
        return socket.create_connection(wire.parse_tcp_endpoint(endpoint), timeout=5)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect("\0" + endpoint[1:])
    return sock


class _Drippers:
    """Drip-feed ``message`` on each of ``socks`` from one thread until the server closes them
    (or the message is out)."""

    def __init__(self, socks: list[socket.socket], message: bytes = HELLO) -> None:
        self.drips = [_Drip(sock, message) for sock in socks]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-drippers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(DRIP):
            for drip in self.drips:
                if not drip.closed.is_set():
                    self._step(drip)

    @staticmethod
    def _step(drip: _Drip) -> None:
        try:
            if select.select([drip.sock], [], [], 0)[0]:
                if drip.sock.recv(4096):
                    drip.answered = True
                else:
                    drip.closed.set()
                    return
            if drip.sent < len(drip.message):
                drip.sock.send(drip.message[drip.sent : drip.sent + 1])
                drip.sent += 1
        except OSError:
            drip.closed.set()

    def all_closed(self) -> bool:
        return all(drip.closed.is_set() for drip in self.drips)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for drip in self.drips:
            drip.sock.close()


@pytest.fixture
def slow_target() -> Iterator[PeerProcess]:
    """A listener that lets 4 handshakes run at once, serves 8 peers and allows 3 s each."""
    config = {"connect_timeout": 3.0, "max_connections": 8, "max_handshakes": 4}
    with PeerProcess(config=config, private=MiB, seed=3) as peer:
        yield peer


def _accepted_or_refused(peer: PeerProcess) -> int:
    stats = peer.call({"cmd": "stats"})
    return int(stats["connections"] + stats["refused"])


def test_drip_fed_handshakes_are_cut_and_never_lock_peers_out(slow_target: PeerProcess) -> None:
    # More drip-feeders than the listener has handshake slots and connection slots together:
    # before, they held every slot past connect_timeout and a new engine's read failed.
    drippers = _Drippers([_connect(slow_target.name) for _ in range(12)])
    try:
        wait_for(
            lambda: _accepted_or_refused(slow_target) >= 12,
            "the listener did not accept every drip-feeder",
        )
        with TransferEngine(TransferConfig.from_env(transport="tcp")) as engine:
            local = engine.register(np.zeros(MiB, dtype=np.uint8))
            request = TransferRequest(
                local, 0, slow_target.name, slow_target.regions["private"], 0, MiB
            )
            batch = engine.submit(TransferOp.READ, [request], timeout=30)
            assert batch.wait() == (TransferStatus.COMPLETED,), batch.errors
            assert local.view == pattern(4, MiB).data
        wait_for(drippers.all_closed, "a drip-feeder stayed connected", timeout=30)
    finally:
        drippers.close()
    # Each was closed while its HELLO was still incomplete (it needs 24 * 0.2 s > 3 s), and
    # none was ever answered.
    assert all(drip.sent < len(HELLO) and not drip.answered for drip in drippers.drips)
    stats = slow_target.call({"cmd": "stats"})
    assert stats["handshake_timeouts"] + stats["handshakes_dropped"] == 12, stats
    assert stats["handshakes_dropped"] >= 12 - 4, stats


def test_drip_fed_handshakes_on_the_shared_memory_socket_are_cut() -> None:
    """The abstract Unix socket that hands out shared-memory fds has the same handshake."""
    with PeerProcess(config={"connect_timeout": 1.0}, shared=MiB) as target:
        endpoint = P2PMetadata(_token()).lookup(target.name, 5).endpoints["shm"]
        drippers = _Drippers([_connect(endpoint) for _ in range(3)])
        try:
            wait_for(drippers.all_closed, "a drip-feeder stayed connected", timeout=30)
        finally:
            drippers.close()
        assert all(drip.sent < len(HELLO) and not drip.answered for drip in drippers.drips)
        stats = target.call({"cmd": "stats"})
        assert stats["handshake_timeouts"] == 3, stats


def test_after_the_handshake_a_drip_fed_control_message_is_cut_at_io_timeout() -> None:
    payload = wire.encode_control(wire.GetSegment())
    frame = wire.HEADER.pack(wire.FrameKind.CONTROL, 0, 0, len(payload), 1) + payload
    with PeerProcess(config={"io_timeout": 1.0}, private=MiB) as target:
        socks = [_connect(target.name) for _ in range(2)]
        for sock in socks:
            wire.client_handshake(sock, _token(), wire.deadline_after(10))
        drippers = _Drippers(socks, frame)  # 1 + 16 + payload bytes take > 3 s
        try:
            wait_for(drippers.all_closed, "a drip-feeder stayed connected", timeout=30)
        finally:
            drippers.close()
        assert all(drip.sent < len(frame) and not drip.answered for drip in drippers.drips)


def test_a_client_that_never_sends_is_closed_and_counted() -> None:
    with PeerProcess(config={"connect_timeout": 0.5}, private=MiB) as target:
        sock = socket.create_connection(wire.parse_tcp_endpoint(target.name), timeout=30)
        with sock:
            assert sock.recv(1) == b"", "the listener answered a client that sent nothing"
        wait_for(lambda: target.call({"cmd": "stats"})["handshake_timeouts"] == 1, "not counted")


class _SlowServer:
    """A raw listener that answers like a kvconnect listener, but drips one message of it a
    byte every DRIP seconds: the SERVER_HELLO (``stage="hello"``) or, after a prompt
    handshake, the reply to the first control call (``stage="control"``)."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.client_left = threading.Event()  # the client hung up before the message was out
        self.finished = threading.Event()  # the whole message went out
        self._thread = threading.Thread(target=self._serve, name="test-slow-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            conn.settimeout(30)
            if self.stage == "control":  # a real handshake, with the suite's token
                wire.server_handshake(conn, _token(), bytes(16), wire.deadline_after(10))
                header = wire.recv_exact(conn, wire.HEADER.size)
                wire.recv_exact(conn, wire.HEADER.unpack(header)[3])
                payload = wire.encode_control(wire.ErrorReply(wire.Status.INTERNAL, "slow"))
                message = wire.HEADER.pack(wire.FrameKind.RESPONSE, 0, 0, len(payload), 0)
                self._drip(conn, message + payload)
            else:
                wire.recv_exact(conn, wire.HELLO.size)
                flags = wire.FLAG_TOKEN if _token() else 0
                hello = wire.SERVER_HELLO.pack(
                    wire.MAGIC, wire.PROTOCOL_VERSION, flags, bytes(16), bytes(16)
                )
                self._drip(conn, hello)

    def _drip(self, conn: socket.socket, message: bytes) -> None:
        for i in range(len(message)):
            try:
                conn.sendall(message[i : i + 1])
            except OSError:
                self.client_left.set()
                return
            if select.select([conn], [], [], DRIP)[0] and not conn.recv(1):
                self.client_left.set()
                return
        self.finished.set()

    def close(self) -> None:
        self.server.close()
        self._thread.join(timeout=30)


@pytest.mark.parametrize("stage", ["hello", "control"])
def test_a_drip_feeding_server_cannot_stretch_the_clients_connect_timeout(stage: str) -> None:
    slow = _SlowServer(stage)
    try:
        if stage == "hello":
            with pytest.raises(PeerUnreachable):
                wire.open_connection(slow.endpoint, _token(), 1.0)
        else:  # the descriptor lookup of a p2p engine: connect, handshake and the call
            config = TransferConfig(transport="tcp", connect_timeout=1.0)
            with TransferEngine(config) as engine:
                local = engine.register(np.zeros(16, dtype=np.uint8))
                request = TransferRequest(local, 0, slow.endpoint, 1, 0, 16)
                batch = engine.submit(TransferOp.READ, [request], timeout=60)
                assert batch.wait() == (TransferStatus.FAILED,)
                assert isinstance(batch.errors[0], PeerUnreachable), batch.errors
        wait_for(lambda: slow.client_left.is_set() or slow.finished.is_set(), "no outcome")
        assert slow.client_left.is_set(), "the client waited for the whole drip-fed message"
    finally:
        slow.close()
