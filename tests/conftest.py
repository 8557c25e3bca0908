"""Shared fixtures: engines, peer processes, hardware markers, a thread-leak check."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import zmq

from kvconnect.auth import curve_keys, secure_client
from kvconnect.testing.conformance import TARGET_BYTES
from kvconnect.testing.etcd import etcd_available
from kvconnect.testing.peer import PeerProcess, pattern
from kvconnect.transfer import TransferConfig, TransferEngine
from kvconnect.transfer.datapath.cuda import cuda_device_count
from kvconnect.transfer.datapath.iov import native_available

DATAPATHS = ["native", "python"]

# Every engine, master and client of the suite (and the processes it starts) authenticates
# with this token, as a secure deployment does; tests of other setups pass their own.
os.environ.setdefault("KVCONNECT_TOKEN", "kvconnect-test-suite-token")


def pytest_configure(config: pytest.Config) -> None:
    """In CI, etcd is part of the set-up (``dev.sh test`` installs it): its tests must run."""
    if os.environ.get("CI") and not etcd_available():
        pytest.exit("CI: etcd is not installed (dev.sh test installs etcd-server)", returncode=1)
    if os.environ.get("KVCONNECT_REQUIRE_RDMA") and not _rdma_present():
        pytest.exit("KVCONNECT_REQUIRE_RDMA is set but no RDMA device is present", returncode=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip hardware tests cleanly where the hardware is absent."""
    gpu = cuda_device_count() > 0
    rdma = _rdma_present()
    for item in items:
        # Markers, not keywords: keywords include directory names (a checkout at .../rdma).
        if item.get_closest_marker("gpu") and not gpu:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))
        if item.get_closest_marker("rdma") and not rdma:
            item.add_marker(pytest.mark.skip(reason="no RDMA device"))


def _rdma_present() -> bool:
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


def native_mode(datapath: str) -> str:
    """Config value for a data-path parameter; the native one must really be built."""
    if datapath == "native" and not native_available():
        pytest.fail("kvconnect._native is not built (pip install with a C compiler)")
    return "on" if datapath == "native" else "off"


def wait_for(condition: Callable[[], bool], message: str, timeout: float = 10.0) -> None:
    """Poll ``condition`` until true; fail with ``message`` after ``timeout`` seconds.

    For state another process or thread updates after the event the test observed (a
    listener counts a refusal after sending it).
    """
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.01)


def kvconnect_threads() -> list[threading.Thread]:
    """Live threads started by kvconnect."""
    return [t for t in threading.enumerate() if t.name.startswith("kvconnect-")]


def wait_no_kvconnect_threads(timeout: float = 5.0) -> list[threading.Thread]:
    """Wait for kvconnect threads to end; returns the ones still alive."""
    end = time.monotonic() + timeout
    while kvconnect_threads() and time.monotonic() < end:
        time.sleep(0.02)
    return kvconnect_threads()


@pytest.fixture(autouse=True, scope="module")
def _no_leaks() -> Iterator[None]:
    """Every module must close what it started: no kvconnect thread or open fd survives it."""
    fds = _open_fds()
    yield
    leaked = wait_no_kvconnect_threads()
    assert not leaked, f"threads leaked: {[t.name for t in leaked]}"
    extra = _open_fds() - fds
    assert not extra, f"file descriptors leaked: {sorted(extra)}"


def _open_fds() -> set[tuple[str, str]]:
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            continue  # the descriptor listdir itself used
    return fds


class ProcessTarget:
    """A conformance Target living in a child process (its shared region)."""

    def __init__(self, peer: PeerProcess) -> None:
        self.peer = peer
        self.name = peer.name
        self.region = peer.regions["shared"]

    def sha256(self, offset: int, length: int) -> str:
        return self.peer.sha256("shared", offset, length)

    def fill(self, seed: int) -> None:
        self.peer.fill("shared", seed)


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    """A started engine with default configuration."""
    with TransferEngine(TransferConfig()) as eng:
        yield eng


@pytest.fixture
def peer() -> Iterator[PeerProcess]:
    """A peer process with 4 MiB shared and 4 MiB private memory, seeded with 7."""
    with PeerProcess(shared=4 << 20, private=4 << 20, seed=7) as proc:
        yield proc


@pytest.fixture
def big_peer() -> Iterator[PeerProcess]:
    """A peer process with a conformance-size shared region."""
    with PeerProcess(shared=TARGET_BYTES, seed=11) as proc:
        yield proc


def seeded(seed: int, size: int) -> np.ndarray:
    """A fresh writable copy of pattern(seed, size)."""
    return pattern(seed, size).copy()


RawDealer = Callable[[str, "str | None", str], "zmq.Socket[bytes]"]


@pytest.fixture
def raw_dealer() -> Iterator[RawDealer]:
    """Opens DEALER sockets that speak to a kvconnect zmq server by hand:
    ``raw_dealer(endpoint, token, purpose)`` is CURVE with the keys of ``token`` for
    ``purpose`` (``"master"``, ``"vllm side channel"``), plain when ``token`` is None. All of
    them are closed after the test."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sockets: list[zmq.Socket[bytes]] = []

    def open_dealer(endpoint: str, token: str | None, purpose: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if token is not None:
            secure_client(sock, curve_keys(token, purpose))
        sock.connect(endpoint)
        sockets.append(sock)
        return sock

    yield open_dealer
    for sock in sockets:
        sock.close(0)
    context.term()
