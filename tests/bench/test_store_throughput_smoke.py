"""``kvconnect bench store --phases throughput`` end to end at a tiny size: a real master and
store server, real loader processes; the report's shape and that every loader got calls
through (the loaders fail on a wrong answer), never its timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_store_throughput_smoke(tmp_path: Path) -> None:
    argv = [
        *(sys.executable, "-m", "kvconnect.cli", "bench", "store", "--phases", "throughput"),
        *("--quick", "--throughput-processes", "2", "--out", "throughput.json"),
    ]
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "throughput.json").read_text())["throughput"]
    assert report["processes"] == 2
    assert set(report["rows"]) == {"batch_exists", "put", "put_rpcs"}
    for kind, row in report["rows"].items():
        assert row["kvconnect"]["median"] > 0, kind
        assert row["kvconnect"]["min"] <= row["kvconnect"]["median"] <= row["kvconnect"]["max"]
