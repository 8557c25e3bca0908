"""Two transfer engines in two processes: the child publishes memory, the parent reads and
writes it with one-sided batches, then checks every byte.

    python examples/transfer_two_peers.py [--transport auto|tcp|shm] [--mib 64]
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np

from kvconnect import TransferConfig, TransferEngine, TransferOp, TransferRequest, TransferStatus
from kvconnect.testing.peer import PeerProcess, pattern


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transport", default="auto", choices=["auto", "tcp", "shm"])
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    size = args.mib << 20
    block = 1 << 20

    # The child: an engine with `size` bytes of shared memory filled with pattern(1).
    with (
        PeerProcess(config={"transport": args.transport}, shared=size, seed=1) as peer,
        TransferEngine(TransferConfig(transport=args.transport)) as engine,
    ):
        local = engine.register(np.zeros(size, dtype=np.uint8))
        requests = [
            TransferRequest(local, off, peer.name, peer.regions["shared"], off, block)
            for off in range(0, size, block)
        ]
        start = time.perf_counter()
        batch = engine.submit(TransferOp.READ, requests, timeout=30)  # returns at once
        statuses = batch.wait()
        elapsed = time.perf_counter() - start
        assert all(s is TransferStatus.COMPLETED for s in statuses), batch
        assert local.view == pattern(1, size).data, "READ returned wrong bytes"
        print(f"READ  {args.mib} MiB in {elapsed * 1e3:.1f} ms ({size / elapsed / 1e9:.2f} GB/s)")

        local.view[:] = pattern(2, size).data
        start = time.perf_counter()
        engine.transfer(TransferOp.WRITE, requests, timeout=30)
        elapsed = time.perf_counter() - start
        assert peer.sha256("shared", 0, size) == hashlib.sha256(local.view).hexdigest()
        print(f"WRITE {args.mib} MiB in {elapsed * 1e3:.1f} ms ({size / elapsed / 1e9:.2f} GB/s)")
        print(
            "per transport:",
            {k: v.bytes_read + v.bytes_written for k, v in engine.stats().transports.items()},
        )


if __name__ == "__main__":
    main()
