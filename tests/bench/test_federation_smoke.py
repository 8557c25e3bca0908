"""``kvconnect bench federation`` at a small size, end to end (two clusters in real processes):
the report has every row, federation never loses a hit isolation has, and each fault was
noticed after one bounded attempt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_a_small_run_reports_hit_rates_latencies_and_fault_costs(tmp_path: Path) -> None:
    out = tmp_path / "federation.json"
    command = [sys.executable, "-m", "kvconnect.cli", "bench", "federation", "--runs", "2"]
    command += ["--prefixes", "24", "--requests", "60", "--pages", "4", "--page-bytes", "16384"]
    command += ["--fault-requests", "40", "--server-size", "64M", "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 2
    for run in report["runs"]:
        isolated, federated = run["isolated"], run["federated"]
        # the federated clusters hold every page either group computed: never fewer hits,
        # and never more than one cache both groups share
        assert run["one_cache_hit_rate"] >= federated["hit_rate"] >= isolated["hit_rate"] > 0
        assert federated["peer_pages"] > 0
        assert isolated["peer_pages"] == 0
        for fault in ("stopped", "killed"):
            # noticed by the first read (the bench fails otherwise), bounded by rpc_timeout
            assert run["faults"][fault]["first_ms"] > 0
            assert run["faults"][fault]["home_p99_us"] > 0
    summary = report["summary"]
    assert summary["hit_rate_ratio"]["min"] >= 1.0
    assert set(summary) >= {
        "recomputed_ratio",
        "hit_rate_ratio_one_cache",
        "federated_vs_one_cache",
        "home_p99_stopped_vs_healthy",
        "first_attempt_killed_ms",
    }
