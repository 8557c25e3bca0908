"""``kvconnect bench p2p`` at a small size, end to end (publisher and peers in network
namespaces behind tbf links): both modes run, every peer's files are checked (the bench fails
otherwise), and a single source sends one copy per peer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect.bench.etcd import etcd_available
from kvconnect.bench.netns import unavailable

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
    pytest.mark.skipif(not etcd_available(), reason="needs etcd"),
]


def test_a_small_run_reports_both_modes_with_ratios(tmp_path: Path) -> None:
    out = tmp_path / "p2p.json"
    command = [sys.executable, "-m", "kvconnect.cli", "bench", "p2p", "--size", "8M"]
    command += ["--peers", "2", "--rate-mbit", "200", "--chunk", "1M", "--runs", "2"]
    done = subprocess.run(
        [*command, "--json", str(out)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["mode"], r["peers"]) for r in report["runs"]] == [
        ("swarm", 2),
        ("single", 2),
    ] * 2
    for row in report["runs"]:
        assert len(row["fetch_seconds"]) == 2
        if row["mode"] == "single":
            assert row["publisher_copies"] == pytest.approx(2.0)  # nobody else serves
        else:
            assert 1.0 <= row["publisher_copies"] <= 2.0
    (summary,) = report["summary"]
    assert summary["ideal_seconds"] == pytest.approx(8 * 2**20 * 8 / 200e6)
    low, high = summary["swarm_over_single_range"]
    assert 0 < low <= summary["swarm_over_single"] <= high
