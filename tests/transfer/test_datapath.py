"""Both data paths (C extension and pure Python) obey one contract."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from kvconnect.errors import ConfigError
from kvconnect.transfer.config import NativeMode
from kvconnect.transfer.datapath.iov import (
    DataPath,
    NativeDataPath,
    PythonDataPath,
    select_datapath,
)
from tests.support.hardware import DATAPATHS, native_mode


@pytest.fixture(params=DATAPATHS)
def datapath(request: pytest.FixtureRequest) -> DataPath:
    mode: NativeMode = native_mode(request.param)  # type: ignore[assignment]
    path = select_datapath(mode)
    assert path.name == request.param
    return path


def _views(sizes: list[int], fill: bool) -> list[memoryview]:
    return [memoryview(bytearray(os.urandom(n) if fill else bytes(n))) for n in sizes]


SIZES = [0, 1, 17, 65536, 300_001, 5, 0, 4096]


def test_scatter_gather_moves_every_byte_in_order(datapath: DataPath) -> None:
    left, right = socket.socketpair()
    left.settimeout(10)
    right.settimeout(10)
    sent = _views(SIZES * 200, fill=True)  # > IOV_MAX buffers, some empty
    got = _views(SIZES * 200, fill=False)
    sender = threading.Thread(target=datapath.sendv, args=(left, sent, 10.0))
    sender.start()
    datapath.recvv(right, got, 10.0)
    sender.join()
    assert b"".join(bytes(v) for v in got) == b"".join(bytes(v) for v in sent)
    left.close()
    right.close()


def test_closed_peer_raises_connection_reset(datapath: DataPath) -> None:
    left, right = socket.socketpair()
    left.sendall(b"abc")
    left.close()
    with pytest.raises(ConnectionResetError):
        datapath.recvv(right, [memoryview(bytearray(10))], 5.0)
    right.close()


def test_stall_raises_timeout(datapath: DataPath) -> None:
    left, right = socket.socketpair()
    right.settimeout(0.2)
    with pytest.raises(TimeoutError):
        datapath.recvv(right, [memoryview(bytearray(10))], 0.2)
    left.close()
    right.close()


def test_copy_many_moves_bytes_and_checks_lengths(datapath: DataPath) -> None:
    srcs = _views([1, 0, 1 << 20, 4097], fill=True)
    dsts = _views([1, 0, 1 << 20, 4097], fill=False)
    datapath.copy_many(dsts, srcs)
    assert dsts == srcs
    with pytest.raises(ValueError, match="differ"):
        datapath.copy_many(dsts[:2], srcs[:1])
    with pytest.raises(ValueError, match="differ"):
        datapath.copy_many([dsts[2][:10]], [srcs[2][:11]])


@pytest.mark.parametrize("shift", [0, 1, 7, 15, 16])
def test_copy_many_moves_large_pieces_at_any_alignment_byte_for_byte(
    datapath: DataPath, shift: int
) -> None:
    """Large pieces take the streaming copy (head bytes to an aligned address, 64-byte
    blocks, a tail): every byte lands, none beside the range."""
    size = (1 << 20) + 37
    source = bytearray(os.urandom(size + 64))
    target = bytearray(size + 64)
    datapath.copy_many(
        [memoryview(target)[shift : shift + size]], [memoryview(source)[3 : 3 + size]]
    )
    assert target[shift : shift + size] == source[3 : 3 + size]
    assert target[:shift] == bytes(shift)
    assert target[shift + size :] == bytes(len(target) - shift - size)


def test_copy_many_within_one_buffer_is_a_memmove(datapath: DataPath) -> None:
    buffer = bytearray(os.urandom(3 << 20))
    want = bytes(buffer[: 2 << 20])
    view = memoryview(buffer)
    datapath.copy_many([view[1 << 20 : 3 << 20]], [view[: 2 << 20]])  # overlapping ranges
    assert bytes(buffer[1 << 20 :]) == want


def test_native_io_releases_the_gil() -> None:
    """While a native receive blocks, Python threads keep running."""
    path = select_datapath(native_mode("native"))  # type: ignore[arg-type]
    assert isinstance(path, NativeDataPath)
    left, right = socket.socketpair()
    ticks = 0
    done = threading.Event()

    def receive() -> None:
        path.recvv(right, [memoryview(bytearray(4))], 5.0)
        done.set()

    thread = threading.Thread(target=receive)
    thread.start()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        ticks += 1
    left.sendall(b"done")
    thread.join()
    assert done.is_set()
    assert ticks > 1000
    left.close()
    right.close()


def test_native_on_without_extension_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvconnect.transfer.datapath.iov.native_available", lambda: False)
    with pytest.raises(ConfigError, match="not built"):
        select_datapath("on")
    assert isinstance(select_datapath("auto"), PythonDataPath)
