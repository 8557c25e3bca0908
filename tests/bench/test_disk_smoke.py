"""``kvconnect bench store --tier disk`` end to end at a tiny size: real master and store
processes with a disk tier on tmp_path, every phase, the report's invariants (bytes checked,
objects recovered), never its timings. Needs the disk tier (issue 16: ``--store-disk``, the
master's tier stats, kvconnect/store/disk/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_store_tier_disk_smoke(tmp_path: Path) -> None:
    argv = [
        *(sys.executable, "-m", "kvconnect.cli", "bench", "store", "--tier", "disk", "--quick"),
        *("--disk-dir", str(tmp_path), "--disk-bytes", "32M", "--disk-dram", "8M"),
        *("--disk-depths", "1,2", "--zipf-dram", "8M", "--zipf-accesses", "600"),
        *("--restart-objects", "2000", "--kill-objects", "120", "--out", "disk.json"),
    ]
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "disk.json").read_text())
    assert [row["object_bytes"] for row in report["raw"]] == [64 << 10, 1 << 20, 4 << 20]
    for row in report["raw"]:
        for side in ("tier_write", "tier_read", "store_write", "store_read"):
            assert row[f"{side}_ratio"]["median"] > 0, side
    (zipf,) = report["zipf"]["rounds"]
    assert zipf["with"]["wrong_bytes"] == zipf["without"]["wrong_bytes"] == 0
    assert zipf["with"]["hit_rate"] >= zipf["without"]["hit_rate"]
    restart = report["restart"]
    assert restart["index_objects"] == restart["reported"] == 2000
    assert restart["sample_good"] == restart["sample"]
    assert restart["sample_wrong"] == 0
    assert restart["first_get_served_s"] is not None
    kill = report["kill"]
    assert kill["wrong_bytes"] == 0, "a killed server's disk never serves a wrong object"
    assert kill["recovered"] >= kill["demoted_before_kill"] > 0
    assert "reason" in report["mooncake"]
    assert not list(tmp_path.glob("kvconnect-bench-disk-*")), "the bench removes its files"
