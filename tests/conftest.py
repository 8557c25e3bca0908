"""Shared fixtures: engines, peer processes, hardware markers, a thread-leak check."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import zmq
from hypothesis import settings

from kvconnect.auth import curve_keys, secure_client
from kvconnect.bench.etcd import etcd_available
from kvconnect.testing.conformance import TARGET_BYTES
from kvconnect.testing.peer import PeerProcess
from kvconnect.transfer import TransferConfig, TransferEngine
from kvconnect.transfer.datapath.cuda import cuda_device_count
from tests.support.dealer import RawDealer
from tests.support.hardware import rdma_present
from tests.support.leaks import open_fds, wait_no_kvconnect_threads

# Every engine, master and client of the suite (and the processes it starts) authenticates
# with this token, as a secure deployment does; tests of other setups pass their own.
os.environ.setdefault("KVCONNECT_TOKEN", "kvconnect-test-suite-token")

# No per-example deadline: on two shared cores a slow example is load, not a failure (the
# suite has no timing thresholds; pytest's timeout still bounds a hung test).
settings.register_profile("kvconnect", deadline=None)
settings.load_profile("kvconnect")


def pytest_configure(config: pytest.Config) -> None:
    """In CI, etcd is part of the set-up (``dev.sh test`` installs it): its tests must run."""
    if os.environ.get("CI") and not etcd_available():
        pytest.exit("CI: etcd is not installed (dev.sh test installs etcd-server)", returncode=1)
    if os.environ.get("KVCONNECT_REQUIRE_RDMA") and not rdma_present():
        pytest.exit("KVCONNECT_REQUIRE_RDMA is set but no RDMA device is present", returncode=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip hardware tests cleanly where the hardware is absent."""
    gpu = cuda_device_count() > 0
    rdma = rdma_present()
    for item in items:
        # Markers, not keywords: keywords include directory names (a checkout at .../rdma).
        if item.get_closest_marker("gpu") and not gpu:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))
        if item.get_closest_marker("rdma") and not rdma:
            item.add_marker(pytest.mark.skip(reason="no RDMA device"))


@pytest.fixture(autouse=True, scope="module")
def _no_leaks() -> Iterator[None]:
    """Every module must close what it started: no kvconnect thread or open fd survives it."""
    fds = open_fds()
    yield
    leaked = wait_no_kvconnect_threads()
    assert not leaked, f"threads leaked: {[t.name for t in leaked]}"
    extra = open_fds() - fds
    assert not extra, f"file descriptors leaked: {sorted(extra)}"


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
