"""kvconnect inside vLLM's own machinery: its MultiConnector (with another connector, stats
from the workers to the front end's log line) and its configuration checks (sleep mode)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY
from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorStats,
)
from vllm.v1.request import RequestStatus

from kvconnect.vllm.connector import KVConnectConnector, KVConnectStats
from tests.vllm.harness import (
    assert_empty,
    handshake,
    kv_worker,
    make_request,
    make_scheduler,
    plan_of,
    run,
    step,
)

PROMPT = list(range(10, 50))  # 40 tokens: 2 full blocks and a partial one
KVCONNECT = {
    "kv_connector": "KVConnectConnector",
    "kv_connector_module_path": "kvconnect.vllm.connector",
    "kv_connector_extra_config": {"lease": 30.0},
}


def _multi(role: str, storage: Path) -> dict[str, Any]:
    """vLLM's MultiConnector over kvconnect and vLLM's ExampleConnector (a disk store)."""
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    children = [{**KVCONNECT, "kv_role": role}, example]
    return {
        "kv_connector": "MultiConnector",
        "kv_connector_module_path": None,
        "kv_role": role,
        "kv_connector_extra_config": {"connectors": children},
    }


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    return tmp_path / "example-connector"


def test_multiconnector_reads_from_prefill_and_its_stats_reach_the_log(
    tiny_config: Path, storage: Path
) -> None:
    p = make_scheduler(tiny_config, "kv_producer", {"lease": 30.0}, engine_id="prefill-engine")
    d = make_scheduler(tiny_config, "kv_consumer", {}, transfer=_multi("kv_consumer", storage),
                       log_stats=True)  # fmt: skip
    try:
        assert isinstance(d.connector, MultiConnector)
        assert any(isinstance(c, KVConnectConnector) for c in d.connector.sub_connectors)
        with kv_worker(seed=1) as (pw, p_caches), kv_worker() as (dw, d_caches):
            handshake(p, pw)
            handshake(d, dw)
            p.add_request(
                make_request("p1", PROMPT, max_tokens=1, params={"do_remote_decode": True})
            )
            _, outputs = step(p, worker=pw)
            d.add_request(
                make_request("d1", PROMPT, max_tokens=2, params=outputs["p1"].kv_transfer_params)
            )
            output, _ = step(d, worker=dw)
            (job,) = plan_of(output).recv  # kvconnect, not the example connector, loads it
            deadline = time.monotonic() + 10
            while d.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                assert time.monotonic() < deadline, "decode never got the KV"
                step(d, worker=dw)
                time.sleep(0.01)
            for name, cache in d_caches.items():
                for local, remote in zip(job.local_blocks[0], job.remote_blocks[0], strict=True):
                    assert torch.equal(cache[:, local], p_caches[name][:, remote])
            step(p, worker=pw)
            assert_empty(p)

            # Each TP rank's MultiConnector reports its children's stats by class name; vLLM
            # sums the ranks', sends them to the front end as plain dicts, and rebuilds them
            # there by registry name before it logs them.
            read = dw.stats.take()
            assert read["pd_reads"] == 1
            ranks = [MultiKVConnectorStats({"KVConnectConnector": KVConnectStats(dict(read))})
                     for _ in range(2)]  # fmt: skip
            _, engine_outputs = run(d, worker=dw, stats=ranks[0].aggregate(ranks[1]))
            (sent,) = [o.scheduler_stats for o in engine_outputs.values() if o.scheduler_stats]
            logging = KVConnectorLogging(d.vllm_config.kv_transfer_config)
            logging.observe(sent.kv_connector_stats)
            lines: list[str] = []
            logging.log(lambda fmt, *args: lines.append(fmt % args))
            (line,) = lines
            assert "KVConnectConnector" in line
            assert "'pd_reads': 2" in line
            assert f"'pd_bytes': {2 * read['pd_bytes']}" in line
            while d.requests:
                step(d, worker=dw)
            assert_empty(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_vllms_prometheus_logger_counts_every_steps_stats(tiny_config: Path) -> None:
    # vLLM's API server builds this from the connector class (build_prom_metrics) and feeds it
    # every step's stats; its log drops an idle interval's (logged at DEBUG).
    d = make_scheduler(tiny_config, "kv_consumer", {})
    try:
        prom = KVConnectorProm(d.vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
        steps = [
            {"pd_reads": 1, "pd_failed": 1, "pd_bytes": 0},
            {"pool_loads": 1, "pool_bytes_loaded": 512},
        ]
        for data in steps:
            prom.observe(KVConnectStats(dict(data)).to_dict(), 0)
        labels = {"model_name": "tiny", "engine": "0"}

        def total(name: str) -> float | None:
            return REGISTRY.get_sample_value(f"kvconnect_vllm_{name}_total", labels)

        assert [total(n) for n in ("pd_reads", "pd_failed", "pool_loads", "pool_bytes_loaded")] == [
            1.0,
            1.0,
            1.0,
            512.0,
        ]
        assert total("pool_saves") == 0.0
    finally:
        d.shutdown()


@pytest.mark.parametrize("multi", [False, True], ids=["alone", "in-multiconnector"])
def test_vllm_refuses_sleep_mode_with_kvconnect(
    tiny_config: Path, storage: Path, multi: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not hasattr(MultiConnector, "supports_sleep_mode"):
        pytest.skip("this vLLM has no sleep-mode check for KV connectors (vLLM < 0.33)")
    from vllm.platforms import current_platform

    # A CPU platform refuses sleep mode itself, before the connector is asked: be a GPU one.
    monkeypatch.setattr(current_platform, "is_sleep_mode_available", lambda: True)
    model = ModelConfig(
        model=str(tiny_config), skip_tokenizer_init=True, dtype="float32", enable_sleep_mode=True
    )
    transfer = _multi("kv_both", storage) if multi else {**KVCONNECT, "kv_role": "kv_both"}
    with pytest.raises(ValueError, match="does not support sleep mode"):
        VllmConfig(model_config=model, kv_transfer_config=KVTransferConfig(**transfer))
    VllmConfig(model_config=model)  # the refusal is the connector's


def test_another_connectors_handshake_is_one_clear_error(
    tiny_config: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """MultiConnector hands every child the first child's handshake metadata."""

    @dataclass
    class Foreign(KVConnectorHandshakeMetadata):
        payload: bytes

    p = make_scheduler(tiny_config, "kv_producer", {"lease": 30.0})
    try:
        with caplog.at_level(logging.ERROR, logger="kvconnect"):
            p.connector.set_xfer_handshake_metadata({0: Foreign(b"nixl")})
        (record,) = [r for r in caplog.records if r.name.startswith("kvconnect")]
        assert record.levelno == logging.ERROR
        assert "list kvconnect first" in record.getMessage()
    finally:
        p.shutdown()
