"""The facade's stats and saved-block events through vLLM's own code: its TP output
aggregator (two workers' outputs merged as vLLM merges them), its pickling across processes,
and the Prometheus metrics vLLM's logger builds from the connector class."""

from __future__ import annotations

import functools
import pickle
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvconnect.vllm.connector import KVConnectConnector, KVConnectSaved, KVConnectStats
from kvconnect.vllm.events import PoolEvents, StoredBlock


def _output(stats: dict[str, object], saved: list[str]) -> ModelRunnerOutput:
    output = ModelRunnerOutput(req_ids=[], req_id_to_index={})
    output.kv_connector_output = KVConnectorOutput(
        kv_connector_stats=KVConnectStats(data=stats),
        kv_cache_events=KVConnectSaved(saved) if saved else None,
    )
    return pickle.loads(pickle.dumps(output))  # as it crosses from a worker process


def test_two_workers_outputs_merge_as_vllm_merges_them() -> None:
    aggregator = KVOutputAggregator(expected_finished_count=2)
    rank0 = _output({"pool_saves": 1, "pool_save_bytes": [100.0]}, ["aa", "bb"])
    rank1 = _output({"pool_saves": 1, "pool_save_bytes": [100.0]}, ["aa"])
    merged = aggregator.aggregate([rank0, rank1]).kv_connector_output
    assert merged.kv_connector_stats.data == {"pool_saves": 2, "pool_save_bytes": [100.0, 100.0]}
    events = PoolEvents(ranks=2)
    assert isinstance(merged.kv_cache_events, KVConnectSaved)
    events.saved(merged.kv_cache_events.hashes)
    assert events.take() == [StoredBlock("aa", None, ())], "bb: one rank of two so far"
    # The scheduler side's stats, merged in as vLLM's scheduler does.
    scheduler = KVConnectStats(data={"pool_lookups": 1, "prefill_held_blocks": 4})
    total = merged.kv_connector_stats.aggregate(scheduler)
    assert total.data["pool_lookups"] == 1
    assert total.data["prefill_held_blocks"] == 4
    assert total.reduce()["pool_save_bytes_mean"] == 100.0


def test_prometheus_counters_histograms_and_gauges() -> None:
    config = SimpleNamespace(kv_transfer_config=None)
    registry = CollectorRegistry()  # vLLM's logger registers its own in the default one
    metrics = KVConnectConnector.build_prom_metrics(
        config,
        {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)},
        ["engine"],
        {0: ["0"]},
    )
    data = {
        "pool_saves": 2,
        "pool_save_bytes": [4096.0, 8192.0],
        "pool_save_duration_seconds": [0.002, 0.2],
        "prefill_held_blocks": 5,
        "not_a_metric": 1,
    }
    metrics.observe(data, 0)
    metrics.observe({"prefill_held_blocks": 3, "pool_saves": 1}, 0)
    labels = {"engine": "0"}

    def sample(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(name, {**labels, **extra})

    assert sample("kvconnect_vllm_pool_saves_total") == 3
    assert sample("kvconnect_vllm_pool_save_bytes_count") == 2
    assert sample("kvconnect_vllm_pool_save_bytes_sum") == 12288
    assert sample("kvconnect_vllm_pool_save_duration_seconds_bucket", le="0.0025") == 1
    assert sample("kvconnect_vllm_prefill_held_blocks") == 3
