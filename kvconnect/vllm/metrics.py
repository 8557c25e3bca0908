"""kvconnect's connector stats on vLLM's Prometheus ``/metrics``.

vLLM's API server logs the connector's stats once per interval, and at DEBUG level when the
engine was idle in it (an interval's stats are then gone from an INFO log); its Prometheus
logger sees every step's stats (the workers' and the scheduler side's, merged, see
:mod:`kvconnect.vllm.stats`). Per engine, each counter becomes ``kvconnect_vllm_<name>_total``,
each series a histogram ``kvconnect_vllm_<name>`` and each gauge ``kvconnect_vllm_<name>``, so
PD reads, failures, leases and pool traffic are counted without a gap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvconnect.vllm.trace import Phase

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
    "pool_save_failed": "Saves to the shared prefix pool that stored not every block",
    "pool_bytes_saved": "Bytes saved to the shared prefix pool",
    "pool_lookups": "Lookups of a request's prefix in the shared pool (scheduler side)",
    "pool_lookup_blocks": "Blocks looked up in the shared pool",
    "pool_hit_blocks": "Blocks looked up that the shared pool held (hit rate: / lookup_blocks)",
    "lease_renewals": "Renewals of prefill's leases on held blocks that decode asked for",
    "lease_expiries": "Prefill leases that lapsed: decode neither read nor gave up the blocks",
    "observations_dropped": "Histogram observations dropped over the per-step bound",
    **{
        f"pd_phase_{phase}_seconds": f"Seconds of prefill/decode reads in phase {phase}"
        for phase in Phase
    },
}
"""The counters (stats keys) and what each counts."""

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BYTES = tuple(float(1 << shift) for shift in range(12, 34, 2))  # 4 KiB .. 8 GiB

HISTOGRAMS: Mapping[str, tuple[str, tuple[float, ...]]] = {
    "pd_load_duration_seconds": (
        "Prefill/decode loads of one request's KV that succeeded (layout, READ, confirmation)",
        _SECONDS,
    ),
    "pd_load_bytes": ("Bytes of one request's prefill/decode load", _BYTES),
    "pool_load_duration_seconds": ("Loads of one request's blocks from the pool", _SECONDS),
    "pool_load_bytes": ("Bytes of one request's load from the pool", _BYTES),
    "pool_save_duration_seconds": ("Saves of one request's blocks to the pool", _SECONDS),
    "pool_save_bytes": ("Bytes of one request's save to the pool (one rank)", _BYTES),
    "pool_lookup_duration_seconds": ("Lookups in the shared pool (scheduler side)", _SECONDS),
}
"""The series (stats keys whose values are lists): documentation and buckets."""

GAUGES: Mapping[str, str] = {
    "prefill_held_blocks": "Blocks prefill holds for decode engines (released on read or lease)",
}
"""The gauges (stats keys of :data:`kvconnect.vllm.stats.GAUGES`)."""


class ConnectorPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]  # vllm is untyped
    """Per engine: a counter per :data:`COUNTERS` entry, a histogram per :data:`HISTOGRAMS`
    entry, a gauge per :data:`GAUGES` entry."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM's metric classes (multiprocess-aware)
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        gauge: Any = self._gauge_cls
        engines = per_engine_labelvalues

        def per_engine(family: Any) -> dict[int, Any]:
            return {engine: family.labels(*values) for engine, values in engines.items()}

        self._counters: dict[str, dict[int, Counter]] = {
            name: per_engine(
                counter(name=f"kvconnect_vllm_{name}", documentation=doc, labelnames=labelnames)
            )
            for name, doc in COUNTERS.items()
        }
        self._histograms: dict[str, dict[int, Histogram]] = {
            name: per_engine(
                histogram(
                    name=f"kvconnect_vllm_{name}",
                    documentation=doc,
                    buckets=buckets,
                    labelnames=labelnames,
                )
            )
            for name, (doc, buckets) in HISTOGRAMS.items()
        }
        self._gauges: dict[str, dict[int, Gauge]] = {
            name: per_engine(
                gauge(
                    name=f"kvconnect_vllm_{name}",
                    documentation=doc,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                )
            )
            for name, doc in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one step's stats (``KVConnectStats.data``) of engine ``engine_idx``."""
        for name, value in transfer_stats_data.items():
            if isinstance(value, list):
                histogram = self._histograms.get(name, {}).get(engine_idx)
                if histogram is not None:
                    for sample in value:
                        histogram.observe(sample)
            elif name in self._gauges:
                if engine_idx in self._gauges[name]:
                    self._gauges[name][engine_idx].set(value)
            else:
                counter = self._counters.get(name, {}).get(engine_idx)
                if counter is not None and value > 0:
                    counter.inc(value)
