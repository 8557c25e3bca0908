"""Single-thread memcpy between pre-faulted buffers, the baseline of the same-host transports."""

from __future__ import annotations

import time

import numpy as np


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
