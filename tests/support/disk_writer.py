"""A child that demotes objects into a DiskTier, a few in flight at any time, and prints each
one reported done (``done KEY OFFSET``) until killed: ``python -m tests.support.disk_writer PATH``.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from kvconnect.store.disk.tier import DiskTier
from kvconnect.store.messages import Moved
from tests.support.disk import demote

SIZES = (4096, 65536, 100_000, 300_001)
IN_FLIGHT = 4


def main() -> None:
    news = threading.Event()
    tier = DiskTier(Path(sys.argv[1]), 64 << 20, queue_bytes=8 << 20, timeout=10.0, wake=news.set)
    tier.open()
    pending: set[Moved] = set()
    offset, i = 0, 0
    while pending or offset + SIZES[i % len(SIZES)] <= tier.size:
        size = SIZES[i % len(SIZES)]
        if len(pending) < IN_FLIGHT and offset + size <= tier.size:
            demote(tier, f"obj-{i}", offset, size)
            pending.add(Moved(f"obj-{i}", offset))
            offset += -(-size // 4096) * 4096
            i += 1
            continue
        news.wait(10.0)
        news.clear()
        out = tier.take_outcomes()
        pending -= {*out.demoted, *out.demote_failed}
        for moved in out.demoted:
            print("done", moved.key, moved.offset, flush=True)
    sys.stdin.read()  # full: wait for the parent's kill


if __name__ == "__main__":
    main()
