"""kvconnect's connector counters on vLLM's Prometheus ``/metrics``.

vLLM's API server logs the connector's stats once per interval, and at DEBUG level when the
engine was idle in it (an interval's stats are then gone from an INFO log); its Prometheus
logger sees every step's stats. Each counter the workers add (``WorkerStats``) becomes a
``kvconnect_vllm_<name>_total`` counter per engine, so PD reads, failures and pool traffic are
counted without a gap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

COUNTERS: Mapping[str, str] = {
    "pd_reads": "Prefill/decode reads of a request's KV (decode side)",
    "pd_failed": "Prefill/decode reads that failed (the request is recomputed or refused)",
    "pd_incompatible": "Prefill/decode reads refused: the prefill engine's KV format differs",
    "pd_bytes": "Bytes read from prefill engines",
    "pd_seconds": "Seconds of whole prefill/decode loads (layout, read, confirmation)",
    "pd_read_seconds": "Seconds of the prefill/decode READs alone",
    "pool_loads": "Loads of blocks from the shared prefix pool",
    "pool_failed": "Loads from the shared prefix pool that failed (recomputed)",
    "pool_bytes_loaded": "Bytes loaded from the shared prefix pool",
    "pool_load_seconds": "Seconds of loads from the shared prefix pool",
    "pool_saves": "Saves of blocks to the shared prefix pool",
    "pool_bytes_saved": "Bytes saved to the shared prefix pool",
}
"""The workers' counters (``WorkerStats`` keys) and what each counts."""


class ConnectorPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]  # vllm is untyped
    """One ``kvconnect_vllm_<name>_total`` counter per :data:`COUNTERS` entry and engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter: Any = self._counter_cls  # vLLM's Counter class (multiprocess-aware)
        self._counters: dict[str, dict[int, Counter]] = {}
        for name, documentation in COUNTERS.items():
            family = counter(
                name=f"kvconnect_vllm_{name}", documentation=documentation, labelnames=labelnames
            )
            self._counters[name] = {
                engine: family.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one step's stats (``KVConnectStats.data``) of engine ``engine_idx``."""
        for name, value in transfer_stats_data.items():
            by_engine = self._counters.get(name)
            if by_engine is not None and engine_idx in by_engine and value > 0:
                by_engine[engine_idx].inc(value)
