"""Baselines measured in the same run as kvconnect, on the same bytes.

- ``SocketBaseline``: a plain Python socket pair across two processes (``sendall`` of each block
  from the same memory, ``recv_into`` a preallocated buffer), one stream.
- ``MemcpyBaseline``: single-thread memcpy of the same blocks between pre-faulted buffers.
- ``MooncakeBaseline``: Mooncake's TCP transfer engine through ``mooncake_runner.py`` when an
  interpreter with the ``mooncake`` package is available.

Each baseline's ``run(op, block, count, batches)`` returns per-batch seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

import numpy as np

_COMMAND = struct.Struct("<cQQ")  # op, block bytes, block count


class Baseline(Protocol):
    """Something that moves ``count`` blocks of ``block`` bytes per batch."""

    name: str

    def run(self, op: str, block: int, count: int, batches: int) -> list[float]:
        """Per-batch seconds of ``batches`` batches."""

    def close(self) -> None:
        """Stop processes."""


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("baseline peer closed")
        got += n


class SocketBaseline:
    """Plain sockets between this process and a child."""

    name = "socket"

    def __init__(self, buffer_bytes: int) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvconnect.bench.baselines", "--serve", str(buffer_bytes)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        port = int(self._proc.stdout.readline())
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = np.ones(buffer_bytes, dtype=np.uint8)

    def run(self, op: str, block: int, count: int, batches: int) -> list[float]:
        view = self._buffer.data
        seconds = []
        ack = memoryview(bytearray(1))
        for _ in range(batches):
            start = time.perf_counter()
            self._sock.sendall(_COMMAND.pack(op[0].encode(), block, count))
            for i in range(count):
                piece = view[i * block : (i + 1) * block]
                if op == "write":
                    self._sock.sendall(piece)
                else:
                    _recv_exact_into(self._sock, piece)
            if op == "write":
                _recv_exact_into(self._sock, ack)
            seconds.append(time.perf_counter() - start)
        return seconds

    def close(self) -> None:
        self._sock.close()
        self._proc.wait(timeout=30)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _serve(buffer_bytes: int) -> None:
    """Child side of SocketBaseline: one connection, commands until EOF."""
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = np.ones(buffer_bytes, dtype=np.uint8).data
    header = memoryview(bytearray(_COMMAND.size))
    while True:
        try:
            _recv_exact_into(conn, header)
        except ConnectionResetError:
            return
        op, block, count = _COMMAND.unpack(header)
        for i in range(count):
            piece = buffer[i * block : (i + 1) * block]
            if op == b"w":
                _recv_exact_into(conn, piece)
            else:
                conn.sendall(piece)
        if op == b"w":
            conn.sendall(b"k")


class MemcpyBaseline:
    """One thread copying the same blocks between two pre-faulted buffers."""

    name = "memcpy"

    def __init__(self, buffer_bytes: int) -> None:
        self._src = np.ones(buffer_bytes, dtype=np.uint8)
        self._dst = np.ones(buffer_bytes, dtype=np.uint8)

    def run(self, op: str, block: int, count: int, batches: int) -> list[float]:
        seconds = []
        for _ in range(batches):
            start = time.perf_counter()
            for i in range(count):
                np.copyto(
                    self._dst[i * block : (i + 1) * block], self._src[i * block : (i + 1) * block]
                )
            seconds.append(time.perf_counter() - start)
        return seconds

    def close(self) -> None:
        """Nothing to stop."""


class MooncakeBaseline:
    """Mooncake's TCP transfer engine, two processes, through mooncake_runner.py."""

    name = "mooncake"

    def __init__(self, python: str, buffer_bytes: int) -> None:
        runner = Path(__file__).with_name("mooncake_runner.py")
        self._proc = subprocess.Popen(
            [python, str(runner), "--buffer", str(buffer_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self._read().get("ready") is not True:
            raise RuntimeError("mooncake runner did not start")

    def run(self, op: str, block: int, count: int, batches: int) -> list[float]:
        assert self._proc.stdin is not None
        command = {"op": op, "block": block, "count": count, "batches": batches}
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        seconds = self._read()["seconds"]
        assert isinstance(seconds, list)
        return [float(s) for s in seconds]

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def _read(self) -> dict[str, object]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"mooncake runner exited ({self._proc.wait(timeout=30)})")
        reply: dict[str, object] = json.loads(line)
        return reply


def find_mooncake_python(explicit: str | None) -> str | None:
    """An interpreter that can import ``mooncake``: ``explicit``, or this one, or None."""
    if explicit:
        return explicit
    return sys.executable if importlib.util.find_spec("mooncake") is not None else None


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", type=int, required=True)
    _serve(parser.parse_args().serve)
