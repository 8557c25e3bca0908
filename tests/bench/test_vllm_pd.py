"""``kvconnect bench vllm``'s options and report (kvconnect/bench/vllm_pd.py): pure, every
environment (the servers themselves run in tests/vllm/test_end_to_end.py)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvconnect.bench import vllm_pd
from kvconnect.vllm.trace import Phase


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    vllm_pd.add_arguments(parser)
    return parser.parse_args(["--vllm-python", "python", *argv])


def _sample(transfer: float | None, decode: float = 0.2, **phases: float) -> dict[str, Any]:
    sample: dict[str, Any] = {"prefill": 1.0, "decode": decode, "ttft": 1.0 + decode}
    sample["transfer"] = transfer
    if phases:
        sample["phases"] = phases
    return sample


def test_options_pick_connectors_extra_config_and_the_phase_breakdown() -> None:
    args = _args("--connectors", "kvconnect", "--phases", "--kvconnect-config", '{"idle_wait": 0}')
    assert args.connectors == ["kvconnect"]
    assert args.phases
    assert args.kvconnect_config == {"idle_wait": 0}
    defaults = _args()
    assert defaults.connectors == ["kvconnect", "nixl"]
    assert not defaults.phases
    assert defaults.kvconnect_config == {}
    assert defaults.sliding_window is None
    assert _args("--sliding-window", "256").sliding_window == 256


def test_the_report_has_medians_spreads_and_both_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--tokens", "1024", "--phases")
    ours = [
        _sample(t, queue_ms=1.0, read_ms=1000 * t, total_ms=30.0, bytes=2**20)
        for t in (0.01, 0.03, 0.02)
    ]
    theirs = [_sample(0.05, decode=0.3), _sample(None), _sample(0.04, decode=0.3)]
    report = vllm_pd._report({"kvconnect": {1024: ours}, "nixl": {1024: theirs}}, args)
    (row,) = report["rows"]
    assert row["median_ms"]["kvconnect"]["transfer"] == pytest.approx(20.0)
    assert row["median_ms"]["nixl"]["transfer"] == pytest.approx(45.0), "no report: left out"
    assert row["transfer_ratio"] == pytest.approx(20 / 45)
    assert row["worst_transfer_ratio"] == pytest.approx(30 / 40), "slowest over fastest"
    assert row["decode_ratio"] == pytest.approx(0.2 / 0.3)
    assert row["kv_bytes"] == 2**20, "what kvconnect read, not the model's full footprint"
    out = capsys.readouterr().out
    assert "20.0 (10.0-30.0)" in out
    assert "45.0 (40.0-50.0)" in out
    phases = out.split("kvconnect read phases")[1].splitlines()
    assert phases[1].split(" | ")[:2] == ["tokens", str(Phase.QUEUE)]
    cells = phases[2].split(" | ")
    assert cells[0] == "1024"
    assert cells[1 + list(Phase).index(Phase.READ)] == "20.00"
    assert cells[-1] == "170.0", "rest: decode's first token minus the whole read"


def test_one_connector_alone_reports_no_ratios() -> None:
    args = _args("--tokens", "1024", "--connectors", "kvconnect")
    report = vllm_pd._report({"kvconnect": {1024: [_sample(0.01)]}}, args)
    (row,) = report["rows"]
    assert row["median_ms"]["kvconnect"]["transfer"] == pytest.approx(10.0)
    assert row["transfer_ratio"] is None
    assert row["worst_transfer_ratio"] is None
    assert row["kv_bytes"] == 1024 * 32 * 1024, "no trace: the full-attention footprint"
