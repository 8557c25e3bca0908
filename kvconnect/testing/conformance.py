"""A transport-independent conformance suite for the transfer engine.

Each ``check_*`` function drives an initiator :class:`TransferEngine` against a :class:`Target`
(another engine, in this process or in a child) and verifies every byte. Tests parametrize them
over every transport and data path; third-party transports can run them unchanged.
"""

from __future__ import annotations

import hashlib
import random
import threading
from typing import Protocol

import numpy as np

from kvconnect.errors import AccessDenied
from kvconnect.testing.peer import pattern
from kvconnect.transfer import TransferOp, TransferRequest, TransferStatus
from kvconnect.transfer.engine import TransferEngine
from kvconnect.transfer.memory import MemoryRegion

MiB = 1 << 20
SIZES = (1, 7, 4096, 65537, MiB + 3, 16 * MiB, 64 * MiB)
TARGET_BYTES = 80 * MiB


class Target(Protocol):
    """The far end: a segment with one region of at least TARGET_BYTES, filled with a seed."""

    name: str
    region: int

    def sha256(self, offset: int, length: int) -> str:
        """Digest of a range of the target region."""

    def fill(self, seed: int) -> None:
        """Reset the region to ``pattern(seed, TARGET_BYTES)``."""


def _digest(data: object) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()  # type: ignore[arg-type]


def _all_completed(statuses: tuple[TransferStatus, ...]) -> bool:
    return all(s is TransferStatus.COMPLETED for s in statuses)


def check_sizes(engine: TransferEngine, local: MemoryRegion, target: Target, seed: int) -> None:
    """READ then WRITE each size of SIZES at unaligned offsets; bytes verified both ways."""
    target.fill(seed)
    expected = pattern(seed, TARGET_BYTES).copy()  # kept equal to the target's content
    for n, size in enumerate(SIZES):
        remote = (n * 4099 + 3) % (TARGET_BYTES - size)
        mine = (n * 8191 + 5) % (local.length - size)
        local.view[mine : mine + size] = b"\0" * size
        engine.read(local, mine, target.name, target.region, remote, size, timeout=60)
        assert local.view[mine : mine + size] == expected[remote : remote + size].data, (
            f"READ of {size} bytes returned wrong data"
        )
        source = pattern(seed + 1000 + n, size)
        local.view[mine : mine + size] = source.data
        engine.write(local, mine, target.name, target.region, remote, size, timeout=60)
        assert target.sha256(remote, size) == _digest(source), f"WRITE of {size} bytes differs"
        expected[remote : remote + size] = source


def check_many_small(
    engine: TransferEngine, local: MemoryRegion, target: Target, seed: int, count: int = 500
) -> None:
    """One batch of ``count`` small, scattered requests each way."""
    target.fill(seed)
    expected = pattern(seed, TARGET_BYTES)
    rng = random.Random(seed)
    spans = []
    cursor = 0
    for _ in range(count):
        size = rng.randint(1, 4096)
        spans.append((cursor, rng.randrange(0, TARGET_BYTES - size), size))
        cursor += size + rng.randint(0, 64)
    requests = [
        TransferRequest(local, lo, target.name, target.region, ro, n) for lo, ro, n in spans
    ]
    batch = engine.submit(TransferOp.READ, requests, timeout=60)
    assert _all_completed(batch.wait()), batch
    for lo, ro, n in spans:
        assert local.view[lo : lo + n] == expected[ro : ro + n].data
    # WRITE back to disjoint places: each request writes its own 1 KiB-aligned slot.
    slots = [(lo, i * 4096 + 1, n) for i, (lo, _ro, n) in enumerate(spans)]
    writes = [TransferRequest(local, lo, target.name, target.region, ro, n) for lo, ro, n in slots]
    batch = engine.submit(TransferOp.WRITE, writes, timeout=60)
    assert _all_completed(batch.wait()), batch
    for lo, ro, n in slots:
        assert target.sha256(ro, n) == _digest(local.view[lo : lo + n])


def check_concurrent(
    engine: TransferEngine, local: MemoryRegion, target: Target, seed: int, threads: int = 4
) -> None:
    """Several threads submit batches at once on disjoint ranges; all bytes verified."""
    target.fill(seed)
    expected = pattern(seed, TARGET_BYTES)
    chunk = 256 * 1024
    errors: list[str] = []

    def worker(t: int) -> None:
        base = t * 16 * chunk
        for round_ in range(8):
            requests = [
                TransferRequest(
                    local,
                    base + i * chunk,
                    target.name,
                    target.region,
                    ((t * 7 + round_ * 3 + i) * chunk + t) % (TARGET_BYTES - chunk),
                    chunk,
                )
                for i in range(16)
            ]
            batch = engine.submit(TransferOp.READ, requests, timeout=60)
            if not _all_completed(batch.wait()):
                errors.append(f"thread {t}: {batch}")
                return
            for r in requests:
                got = local.view[r.local_offset : r.local_offset + r.length]
                if got != expected[r.remote_offset : r.remote_offset + r.length].data:
                    errors.append(f"thread {t}: wrong bytes")
                    return

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=120)
    assert not errors, errors


def check_refusals(engine: TransferEngine, local: MemoryRegion, target: Target, seed: int) -> None:
    """Out-of-bounds and unknown-region requests fail with AccessDenied; nothing moves."""
    target.fill(seed)
    before = target.sha256(0, TARGET_BYTES)
    local.view[:4096] = b"\x5a" * 4096
    bad = [
        (target.region, TARGET_BYTES - 100, 200),  # runs past the end
        (target.region, TARGET_BYTES, 1),  # starts at the end
        (987654, 0, 16),  # no such region
    ]
    for op in (TransferOp.READ, TransferOp.WRITE):
        for region, offset, size in bad:
            request = TransferRequest(local, 0, target.name, region, offset, size)
            batch = engine.submit(op, [request], timeout=30)
            assert batch.wait() == (TransferStatus.FAILED,), (op, region, offset, batch)
            assert isinstance(batch.errors[0], AccessDenied), batch.errors
    assert local.view[:4096] == b"\x5a" * 4096, "a refused READ changed local memory"
    assert target.sha256(0, TARGET_BYTES) == before, "a refused WRITE changed the target"


class EngineTarget:
    """A :class:`Target` backed by an engine in this process."""

    def __init__(self, engine: TransferEngine, shared: bool = True) -> None:
        self.engine = engine
        self._region = (
            engine.allocate(TARGET_BYTES)
            if shared
            else engine.register(np.zeros(TARGET_BYTES, dtype=np.uint8))
        )
        self.name = engine.name
        self.region = self._region.id

    def sha256(self, offset: int, length: int) -> str:
        return _digest(self._region.view[offset : offset + length])

    def fill(self, seed: int) -> None:
        self._region.view[:] = pattern(seed, TARGET_BYTES).data
