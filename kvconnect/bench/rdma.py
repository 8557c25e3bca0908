"""The time it takes to register memory with an RDMA NIC (reported by ``kvconnect bench
transfer`` with the rdma transport; perftest, its baseline, is in :mod:`.baselines.perftest`)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvconnect.transfer.memory import MemoryRegistry
from kvconnect.transfer.transports.rdma import verbs as rdma_verbs


def registration_seconds(sizes: list[int]) -> list[dict[str, Any]]:
    """Seconds to register pre-faulted host buffers of ``sizes`` bytes on the first NIC."""
    nic = rdma_verbs.Nic(rdma_verbs.device_names()[0], None)
    registry = MemoryRegistry()
    results = []
    try:
        for size in sizes:
            region = registry.register(np.ones(size, dtype=np.uint8))
            start = time.perf_counter()
            registered = nic.register(region)
            seconds = time.perf_counter() - start
            registered.close()
            registry.unregister(region)
            results.append({"bytes": size, "seconds": seconds, "gbps": size / seconds / 1e9})
    finally:
        registry.close()
        nic.close()
    return results
