"""A plain Python socket pair across two processes, the baseline of the tcp transport: ``sendall``
of each block from the same memory, ``recv_into`` a preallocated buffer, one stream."""

from __future__ import annotations

import argparse
import socket
import struct
import subprocess
import sys
import time

import numpy as np

_COMMAND = struct.Struct("<cQQ")  # op, block bytes, block count


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
            [
                sys.executable,
                "-m",
                "kvconnect.bench.baselines.socket_pair",
                "--serve",
                str(buffer_bytes),
            ],
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", type=int, required=True)
    _serve(parser.parse_args().serve)
