"""wait_readable: polls, then sleeps, never past its timeout, and never holding the GIL."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvconnect.transfer.datapath import polling

# The C extension polls; without it every wait sleeps at once (same contract).
IMPLEMENTATIONS = ["native", "python"]


@pytest.fixture(params=IMPLEMENTATIONS)
def wait(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> object:
    if request.param == "python":
        monkeypatch.setattr(polling, "_native_wait", None)
    elif polling._native_wait is None:
        pytest.skip("kvconnect._native is not built")
    return polling.wait_readable


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    with a, b:
        yield a, b


def test_bytes_already_there_are_found_at_once(
    wait: object, pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    b.send(b"x")
    assert polling.wait_readable(a.fileno(), 5.0, 5.0)
    assert a.recv(1) == b"x"  # polling consumed nothing


def test_nothing_arrives_until_the_timeout(
    wait: object, pair: tuple[socket.socket, socket.socket]
) -> None:
    a, _ = pair
    start = time.monotonic()
    assert not polling.wait_readable(a.fileno(), 0.02, 0.1)
    assert time.monotonic() - start >= 0.1


@pytest.mark.parametrize("window", [0.0, 30.0])
def test_bytes_sent_by_another_python_thread_end_the_wait(
    wait: object, pair: tuple[socket.socket, socket.socket], window: float
) -> None:
    """The other thread needs the GIL to send: a poll that held it would time out instead."""
    a, b = pair
    started = threading.Event()

    def send_later() -> None:
        started.wait()
        b.send(b"y")

    sender = threading.Thread(target=send_later)
    sender.start()
    started.set()
    assert polling.wait_readable(a.fileno(), window, 30.0)
    sender.join()
    assert a.recv(1) == b"y"


def test_a_peer_that_hangs_up_ends_the_wait(
    wait: object, pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    b.shutdown(socket.SHUT_WR)
    assert polling.wait_readable(a.fileno(), 30.0, 30.0)
    assert a.recv(1) == b""


def test_a_closed_sockets_descriptor_fails_at_once(wait: object) -> None:
    a, b = socket.socketpair()
    a.close()
    b.close()
    with pytest.raises(OSError, match="not an open descriptor"):  # not a 30 s sleep
        polling.wait_readable(a.fileno(), 30.0, 30.0)


def test_the_extension_refuses_negative_and_nan_windows() -> None:
    native = pytest.importorskip("kvconnect._native")
    for spin, timeout in ((-1.0, 1.0), (0.0, -1.0), (float("nan"), 1.0)):
        with pytest.raises(ValueError, match=">= 0"):
            native.wait_readable(0, spin, timeout)
