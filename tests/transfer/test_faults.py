"""Faults with real processes and sockets: killed and stopped peers, bad tokens, garbage."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import struct
import time

import numpy as np
import pytest

from kvconnect.errors import (
    AuthenticationError,
    BrokenError,
    ClosedError,
    PeerUnreachable,
    RegionBusy,
)
from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import (
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    TransferStatus,
)
from kvconnect.transfer.protocol import wire
from tests.support.leaks import kvconnect_threads
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

MiB = 1 << 20


class _Stopped:
    """SIGSTOP a peer (waiting until every thread is really stopped); SIGCONT on resume()."""

    def __init__(self, peer: PeerProcess) -> None:
        self.pid = peer.pid
        self.running = False
        os.kill(self.pid, signal.SIGSTOP)
        wait_for(self._all_stopped, "the peer did not stop")

    def _all_stopped(self) -> bool:
        states = []
        for task in os.listdir(f"/proc/{self.pid}/task"):
            with open(f"/proc/{self.pid}/task/{task}/stat", encoding="ascii") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        return all(state in ("T", "t") for state in states)

    def resume(self) -> None:
        if not self.running:
            self.running = True
            os.kill(self.pid, signal.SIGCONT)

    def __enter__(self) -> _Stopped:
        return self

    def __exit__(self, *exc: object) -> None:
        self.resume()


@pytest.mark.parametrize(("transport", "total"), [("tcp", 2048 * MiB), ("shm", 8192 * MiB)])
def test_sigkill_mid_batch_fails_before_deadline_and_engine_serves_others(
    transport: str, total: int
) -> None:
    config = TransferConfig(transport=transport)  # type: ignore[arg-type]
    with TransferEngine(config) as engine:
        served = engine.allocate(MiB)
        served.view[:] = pattern(5, MiB).data
        local = engine.register(np.zeros(64 * MiB, dtype=np.uint8))
        with PeerProcess(config={"transport": transport}, shared=64 * MiB, seed=1) as victim:
            requests = [
                TransferRequest(local, 0, victim.name, victim.regions["shared"], 0, 4 * MiB)
                for _ in range(total // (4 * MiB))
            ]
            deadline = 60.0
            start = time.monotonic()
            batch = engine.submit(TransferOp.READ, requests, timeout=deadline)
            while engine.stats().transports[transport].bytes_read == 0:
                time.sleep(0.001)
            victim.kill()
            statuses = batch.wait()
            elapsed = time.monotonic() - start
        assert elapsed < deadline / 2, f"batch took {elapsed:.1f}s to fail"
        assert TransferStatus.FAILED in statuses, "the kill landed after the batch completed"
        assert TransferStatus.TIMEOUT not in statuses
        failures = [e for e in batch.errors if e is not None]
        assert all(isinstance(e, BrokenError) for e in failures), failures
        # The engine still serves: a third process reads from it.
        with PeerProcess(config={"transport": transport}, private=MiB) as third:
            assert third.transfer("read", engine.name, served.id, [(0, 0, MiB)]) == ["completed"]
            want = hashlib.sha256(pattern(5, MiB)).hexdigest()
            assert third.sha256("private", 0, MiB) == want
        # and a new request to the dead segment fails fast, not at its deadline
        start = time.monotonic()
        batch = engine.submit(TransferOp.READ, requests[:1], timeout=deadline)
        assert batch.wait() == (TransferStatus.FAILED,)
        assert isinstance(batch.errors[0], PeerUnreachable)
        assert time.monotonic() - start < deadline / 2


def test_timed_out_read_never_writes_late(peer: PeerProcess) -> None:
    with TransferEngine(TransferConfig(transport="tcp")) as engine:
        local = engine.register(np.full(MiB, 0x5A, dtype=np.uint8))
        engine.read(local, 0, peer.name, peer.regions["private"], 0, 16)  # connect first
        local.view[:16] = b"\x5a" * 16
        request = TransferRequest(local, 0, peer.name, peer.regions["private"], 0, MiB)
        with _Stopped(peer) as stopped:
            start = time.monotonic()
            batch = engine.submit(TransferOp.READ, [request], timeout=0.5)
            assert batch.wait() == (TransferStatus.TIMEOUT,)
            assert time.monotonic() - start < 5
            stopped.resume()  # the peer now answers the abandoned request
            time.sleep(0.5)
        assert bytes(local.view) == b"\x5a" * MiB, "bytes landed after the request timed out"
        engine.read(local, 0, peer.name, peer.regions["private"], 0, MiB)  # engine still works
        assert local.view == pattern(8, MiB).data


def test_unregister_refused_while_in_use_and_allowed_after(peer: PeerProcess) -> None:
    with TransferEngine(TransferConfig(transport="tcp")) as engine:
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        request = TransferRequest(local, 0, peer.name, peer.regions["private"], 0, MiB)
        engine.transfer(TransferOp.READ, [request])
        with _Stopped(peer):
            batch = engine.submit(TransferOp.READ, [request], timeout=30)
            with pytest.raises(RegionBusy):
                engine.unregister(local)
        assert batch.wait() == (TransferStatus.COMPLETED,)
        engine.unregister(local)


def test_close_fails_pending_work_promptly(peer: PeerProcess) -> None:
    engine = TransferEngine(TransferConfig(transport="tcp"))
    engine.start()
    local = engine.register(np.zeros(MiB, dtype=np.uint8))
    request = TransferRequest(local, 0, peer.name, peer.regions["private"], 0, MiB)
    engine.transfer(TransferOp.READ, [request])
    with _Stopped(peer):
        batch = engine.submit(TransferOp.READ, [request] * 8, timeout=60)
        start = time.monotonic()
        engine.close()
        assert batch.wait(timeout=10) == (TransferStatus.FAILED,) * 8
        assert time.monotonic() - start < 10
        assert all(isinstance(e, ClosedError) for e in batch.errors)


@pytest.mark.parametrize(("mine", "theirs"), [("wrong", "right"), (None, "right"), ("right", None)])
def test_token_mismatch_is_refused(mine: str | None, theirs: str | None) -> None:
    with (
        PeerProcess(config={"token": theirs}, private=MiB, seed=1) as target,
        TransferEngine(TransferConfig(token=mine)) as engine,
    ):
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        request = TransferRequest(local, 0, target.name, target.regions["private"], 0, MiB)
        batch = engine.submit(TransferOp.READ, [request], timeout=10)
        assert batch.wait() == (TransferStatus.FAILED,)
        assert isinstance(batch.errors[0], AuthenticationError), batch.errors
        assert bytes(local.view) == bytes(MiB)
        if theirs is not None and mine is not None:
            wait_for(lambda: target.call({"cmd": "stats"})["auth_failures"] >= 1, "not counted")


def test_matching_token_moves_data() -> None:
    with (
        PeerProcess(config={"token": "s3cret"}, shared=MiB, seed=2) as target,
        TransferEngine(TransferConfig(token="s3cret")) as engine,
    ):
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        for transport_region in ("shared",):
            engine.read(local, 0, target.name, target.regions[transport_region], 0, MiB)
            assert local.view == pattern(2, MiB).data


def _raw(endpoint: str) -> socket.socket:
    return socket.create_connection(wire.parse_tcp_endpoint(endpoint), timeout=5)


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def _handshaken(endpoint: str) -> socket.socket:
    sock = _raw(endpoint)
    wire.client_handshake(sock, TransferConfig.from_env().token, wire.deadline_after(5))
    return sock


MALFORMED = {
    "random-bytes": lambda s: s.sendall(os.urandom(4096)),
    "zero-entries": lambda s: s.sendall(wire.HEADER.pack(wire.FrameKind.READ, 0, 0, 0, 1)),
    "too-many-entries": lambda s: s.sendall(wire.HEADER.pack(wire.FrameKind.READ, 0, 5000, 0, 1)),
    "unknown-kind": lambda s: s.sendall(wire.HEADER.pack(99, 0, 1, 0, 1)),
    "oversized-frame": lambda s: s.sendall(
        wire.HEADER.pack(wire.FrameKind.WRITE, 0, 1, 0, 1) + struct.pack("<QQQ", 1, 0, 1 << 40)
    ),
    "huge-control": lambda s: s.sendall(wire.HEADER.pack(wire.FrameKind.CONTROL, 0, 0, 1 << 30, 1)),
    "garbage-control": lambda s: s.sendall(
        wire.HEADER.pack(wire.FrameKind.CONTROL, 0, 0, 8, 1) + b"\xc1" * 8
    ),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_input_drops_only_that_connection(kind: str, peer: PeerProcess) -> None:
    with TransferEngine(TransferConfig(transport="tcp")) as engine:
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        engine.read(local, 0, peer.name, peer.regions["private"], 0, MiB)  # a live stream
        sock = _raw(peer.name) if kind == "random-bytes" else _handshaken(peer.name)
        with sock:
            MALFORMED[kind](sock)
            assert _closed_by_peer(sock)
        stats = peer.call({"cmd": "stats"})
        assert stats["protocol_errors"] >= 1
        local.view[:] = b"\0" * MiB
        engine.read(local, 0, peer.name, peer.regions["private"], 0, MiB)  # listener still serves
        assert local.view == pattern(8, MiB).data


def test_refused_write_leaves_stream_usable(peer: PeerProcess) -> None:
    """A WRITE the target refuses is drained, not obeyed; the same connection goes on."""
    with TransferEngine(TransferConfig(transport="tcp", tcp_streams=1)) as engine:
        local = engine.register(pattern(9, 2 * MiB).copy())
        bad = TransferRequest(local, 0, peer.name, peer.regions["private"], 3 * MiB, 2 * MiB)
        good = TransferRequest(local, 0, peer.name, peer.regions["private"], 0, MiB)
        before = peer.sha256("private", 0, 4 * MiB)
        batch = engine.submit(TransferOp.WRITE, [bad], timeout=10)
        assert batch.wait() == (TransferStatus.FAILED,)
        assert peer.sha256("private", 0, 4 * MiB) == before
        engine.transfer(TransferOp.WRITE, [good])
        assert peer.sha256("private", 0, MiB) == hashlib.sha256(pattern(9, MiB)).hexdigest()


def test_broken_stream_is_retried_on_another_stream() -> None:
    config = TransferConfig(transport="tcp", tcp_streams=2)
    with TransferEngine(config) as target, TransferEngine(config) as engine:
        remote = target.allocate(64 * MiB)
        remote.view[:] = pattern(4, 64 * MiB).data
        local = engine.register(np.zeros(64 * MiB, dtype=np.uint8))
        requests = [
            TransferRequest(local, i * MiB, target.name, remote.id, i * MiB, MiB) for i in range(64)
        ]
        for _ in range(20):
            local.view[:] = b"\0" * (64 * MiB)
            batch = engine.submit(TransferOp.READ, requests, timeout=30)
            while engine.stats().transports["tcp"].bytes_read == 0:
                time.sleep(0.0005)
            # Real fault: the target drops one of its connections mid-batch.
            connections = list(target._listener._connections)  # type: ignore[union-attr]
            wire.shutdown_quietly(connections[0])
            assert batch.wait() == (TransferStatus.COMPLETED,) * 64
            assert local.view == remote.view
            if engine.stats().transports["tcp"].retries:
                break
        assert engine.stats().transports["tcp"].retries > 0


def test_restarted_peer_on_same_port_is_detected() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    config = {"listen_port": port, "transport": "tcp"}
    with TransferEngine(TransferConfig(transport="tcp")) as engine:
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        with PeerProcess(config=config, private=MiB, seed=1) as first:
            region = first.regions["private"]
            engine.read(local, 0, first.name, region, 0, MiB)
            first.kill()
        with PeerProcess(config=config, private=2 * MiB, seed=3) as second:
            assert second.name == first.name
            batch = engine.submit(
                TransferOp.READ, [TransferRequest(local, 0, second.name, region, 0, MiB)]
            )
            assert batch.wait() == (TransferStatus.FAILED,)
            assert isinstance(batch.errors[0], PeerUnreachable)
            # the next request re-resolves the segment and reaches the new engine
            engine.read(local, 0, second.name, second.regions["private"], 0, MiB)
            assert local.view == pattern(4, 2 * MiB)[:MiB].data


def test_idle_channels_retire_and_come_back(peer: PeerProcess) -> None:
    config = TransferConfig(transport="tcp", idle_timeout=0.3)
    with TransferEngine(config) as engine:
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        engine.read(local, 0, peer.name, peer.regions["private"], 0, MiB)
        assert any(t.name.startswith("kvconnect-tcp") for t in kvconnect_threads())
        deadline = time.monotonic() + 10
        while any(t.name.startswith("kvconnect-tcp") for t in kvconnect_threads()):
            assert time.monotonic() < deadline, "idle TCP streams did not retire"
            time.sleep(0.05)
        local.view[:] = b"\0" * MiB
        engine.read(local, 0, peer.name, peer.regions["private"], 0, MiB)  # a new channel
        assert local.view == pattern(8, MiB).data


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_forgotten_segment_leaves_no_connection_mapping_or_descriptor(
    peer: PeerProcess, transport: str
) -> None:
    """What a user of the engine calls for a peer it knows is gone (kvconnect.vllm: a prefill
    replaced or aged out): the peer's state goes at once; the name is looked up afresh."""
    with TransferEngine(TransferConfig(transport=transport)) as engine:
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        engine.forget_segment("never-seen:1")  # nothing known: nothing to do
        engine.read(local, 0, peer.name, peer.regions["shared"], 0, MiB)
        assert engine.stats().transports[transport].peers == 1
        engine.forget_segment(peer.name)
        assert engine.stats().transports[transport].peers == 0
        assert engine._directory.cached(peer.name) is None
        local.view[:] = b"\0" * MiB
        engine.read(local, 0, peer.name, peer.regions["shared"], 0, MiB)
        assert engine.stats().transports[transport].peers == 1
        assert local.view == pattern(7, MiB).data


def test_dead_same_host_peer_is_unmapped_while_idle() -> None:
    with TransferEngine(TransferConfig(transport="shm")) as engine:
        local = engine.register(np.zeros(MiB, dtype=np.uint8))
        with PeerProcess(config={"transport": "shm"}, shared=16 * MiB, seed=1) as victim:
            engine.read(local, 0, victim.name, victim.regions["shared"], 0, MiB)
            assert _mapped_memfds() == 1
            victim.kill()
            deadline = time.monotonic() + 10
            while _mapped_memfds():  # nobody uses the engine: the watch thread must notice
                assert time.monotonic() < deadline, "a dead peer's memory stayed mapped"
                time.sleep(0.05)


def _mapped_memfds() -> int:
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        return sum("memfd:kvconnect-region" in line for line in maps)


def test_connection_flood_is_capped_and_listener_survives() -> None:
    """Silent connections beyond max_handshakes push out the oldest; a peer still gets in."""
    config = TransferConfig(max_connections=8, max_handshakes=8)
    with (
        TransferEngine(config) as target,
        TransferEngine(TransferConfig(transport="tcp")) as engine,
    ):
        remote = target.allocate(MiB)
        remote.view[:] = pattern(2, MiB).data
        flood = [_raw(target.name) for _ in range(32)]
        try:
            wait_for(
                lambda: target.stats().listener.handshakes_dropped >= 32 - 8,
                "the flood was not capped",
            )
            assert target.stats().listener.refused == 0  # no authenticated slot was taken
            local = engine.register(np.zeros(MiB, dtype=np.uint8))
            engine.read(local, 0, target.name, remote.id, 0, MiB)  # while the flood is open
            assert local.view == remote.view
        finally:
            for sock in flood:
                sock.close()
