"""Mooncake Transfer Engine (TCP) driven for kvconnect's benchmark: a standalone script.

Runs with any interpreter that has ``mooncake`` (the ``mooncake-transfer-engine-non-cuda`` wheel)
and numpy; it imports nothing from kvconnect. The parent starts it with ``--buffer BYTES``; it
starts its own target child, prints ``{"ready": true}`` and then answers JSON commands on stdin,
one per line: ``{"op": "read"|"write", "block": B, "count": N, "batches": K}`` → per-batch
seconds. Transfers are verified once per block size. EOF ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np
from mooncake.engine import TransferEngine

HOST = "127.0.0.1"


def _engine(size: int) -> tuple[TransferEngine, np.ndarray]:
    engine = TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake initialize failed")
    buffer = np.ones(size, dtype=np.uint8)
    if engine.register_memory(buffer.ctypes.data, size) != 0:
        raise RuntimeError("mooncake register_memory failed")
    return engine, buffer


def _target(size: int) -> None:
    engine, buffer = _engine(size)
    print(json.dumps({"segment": f"{HOST}:{engine.get_rpc_port()}", "addr": buffer.ctypes.data}))
    sys.stdout.flush()
    sys.stdin.read()
    engine.unregister_memory(buffer.ctypes.data)


def _initiator(size: int) -> None:
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--role", "target", "--buffer", str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        info = json.loads(child.stdout.readline())
        engine, local = _engine(2 * size)
        verified = set()
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            block, count = cmd["block"], cmd["count"]
            local_addrs = [local.ctypes.data + i * block for i in range(count)]
            remote_addrs = [info["addr"] + i * block for i in range(count)]
            lengths = [block] * count
            if block not in verified:
                _verify(engine, info["segment"], local, local_addrs, remote_addrs, lengths)
                verified.add(block)
            call = (
                engine.batch_transfer_sync_read
                if cmd["op"] == "read"
                else engine.batch_transfer_sync_write
            )
            seconds = []
            for _ in range(cmd["batches"]):
                start = time.perf_counter()
                if call(info["segment"], local_addrs, remote_addrs, lengths) != 0:
                    raise RuntimeError("mooncake transfer failed")
                seconds.append(time.perf_counter() - start)
            print(json.dumps({"seconds": seconds}), flush=True)
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def _verify(
    engine: TransferEngine,
    segment: str,
    local: np.ndarray,
    local_addrs: list[int],
    remote_addrs: list[int],
    lengths: list[int],
) -> None:
    total = sum(lengths)
    local[:total] = np.random.default_rng(len(lengths)).integers(0, 256, total, dtype=np.uint8)
    expected = local[:total].copy()
    if engine.batch_transfer_sync_write(segment, local_addrs, remote_addrs, lengths) != 0:
        raise RuntimeError("mooncake verify write failed")
    local[:total] = 0
    if engine.batch_transfer_sync_read(segment, local_addrs, remote_addrs, lengths) != 0:
        raise RuntimeError("mooncake verify read failed")
    if not np.array_equal(local[:total], expected):
        raise RuntimeError("mooncake returned wrong bytes")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["initiator", "target"], default="initiator")
    parser.add_argument("--buffer", type=int, required=True)
    args = parser.parse_args()
    (_target if args.role == "target" else _initiator)(args.buffer)


if __name__ == "__main__":
    main()
