"""Baselines measured in the same run as kvconnect, on the same bytes: one module per baseline.

- :mod:`.socket_pair`: a plain Python socket pair across two processes (``sendall`` of each
  block from the same memory, ``recv_into`` a preallocated buffer), one stream.
- :mod:`.memcpy`: single-thread memcpy of the same blocks between pre-faulted buffers.
- :mod:`.direct_io`: raw disk throughput of one file (fio, else an O_DIRECT loop), the disk
  tier's baseline (``kvconnect bench store --tier disk``).
- :mod:`.mooncake_engine`: Mooncake's TCP transfer engine through ``mooncake_runner.py``, run by an
  interpreter with the ``mooncake`` package.
- :mod:`.mooncake_store`: Mooncake Store through ``mooncake_store_runner.py`` (its own master and
  store server), for ``kvconnect bench store``.
- :mod:`.perftest`: perftest (``ib_write_bw``/``ib_read_bw``), the baseline of the rdma transport.
- :mod:`.nixl`: vLLM's NixlConnector, the baseline of ``kvconnect bench vllm``.

The runners are scripts for Mooncake's own interpreter: they import no kvconnect.

Each transfer baseline's ``run(op, block, count, batches)`` returns per-batch seconds.
"""

from __future__ import annotations

from typing import Protocol


class Baseline(Protocol):
    """Something that moves ``count`` blocks of ``block`` bytes per batch."""

    name: str

    def run(self, op: str, block: int, count: int, batches: int) -> list[float]:
        """Per-batch seconds of ``batches`` batches."""

    def close(self) -> None:
        """Stop processes."""
