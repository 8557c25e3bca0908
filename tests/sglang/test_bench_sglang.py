"""``kvconnect bench sglang`` end to end, tiny: every backend through SGLang's controller."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.child import child_env

pytestmark = [pytest.mark.integration, pytest.mark.sglang]

SYSTEMS = ("kvconnect", "kvconnect-shm", "mooncake", "file")
PAGES, ROUNDS, STALL_ROUNDS = 8, 1, 1


def test_a_tiny_run_reports_every_backend_and_reads_back_what_it_wrote(tmp_path: Path) -> None:
    # A child process: Mooncake's client keeps sockets and files open after it is closed.
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "kvconnect.cli", "bench", "sglang"),
            *("--pages", str(PAGES), "--rounds", str(ROUNDS), "--stall-rounds", str(STALL_ROUNDS)),
            *("--layers", "2", "--heads", "2", "--head-dim", "8"),
            *("--file-dir", str(tmp_path), "--out", str(out)),
        ],
        env=child_env(),
        timeout=300,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["shape"]["page_bytes"] == 2 * 2 * 16 * 2 * 8 * 2
    assert list(report["throughput"]) == list(SYSTEMS)
    for name in SYSTEMS:
        for op in ("backup", "prefetch"):
            row = report["throughput"][name][op]
            assert len(row["pages_per_s_rounds"]) == ROUNDS
            assert row["pages_per_s"] > 0
            assert row["batch_p99_ms"] >= row["batch_p50_ms"] > 0
    # every prefetched page was compared byte for byte: warm-up and measured rounds in full,
    # and the stall phase's reused pages
    stalled = {n: r for n, r in report["stall"].items() if r is not None}
    assert set(stalled) == {"kvconnect", "kvconnect-shm", "mooncake"}, "file has no server"
    for name in SYSTEMS:
        reused = round(stalled[name]["reused_fraction"] * PAGES) if name in stalled else 0
        assert report["verified_pages"][name] == (ROUNDS + 1) * PAGES + reused
    assert set(report["ratios"]) == {
        f"{ours}/{theirs}" for ours in SYSTEMS[:2] for theirs in SYSTEMS[2:]
    }
