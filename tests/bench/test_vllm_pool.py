"""The report and plot of ``kvconnect bench vllm-pool`` (kvconnect/bench/vllm_pool.py) from
known samples: pure, every environment with matplotlib (the bench extra). The bench itself
runs in tests/vllm/test_bench_pool.py."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect.bench import vllm_pool
from kvconnect.bench.vllm_pool import Series


def _samples(**ttfts: list[float]) -> dict[Series, dict[int, list[vllm_pool.Sample]]]:
    samples: dict[Series, dict[int, list[vllm_pool.Sample]]] = {s: {2048: []} for s in Series}
    for name, values in ttfts.items():
        samples[Series[name.upper()]][2048] = [{"ttft": v, "load_seconds": v / 4} for v in values]
    return samples


def test_ratios_are_of_medians_with_the_per_round_range(tmp_path: Path) -> None:
    args = argparse.Namespace(tokens=[2048], rounds=3)
    samples = _samples(kvconnect_hit=[0.1, 0.3, 0.2], recompute=[1.0, 2.0, 4.0])
    unavailable = {"mooncake": "no wheel"}
    report = vllm_pool.report(samples, unavailable, args, vllm_pool.SHAPES["bench"])

    (row,) = report["rows"]
    assert row["kv_bytes"] == 2048 * 32 * 1024  # 32 KiB of KV per token
    assert set(row["ttft"]) == {"kvconnect-hit", "recompute"}
    hit = row["ttft"]["kvconnect-hit"]
    assert (hit["median_ms"], hit["min_ms"], hit["max_ms"], hit["n"]) == (200, 100, 300, 3)
    assert hit["load_median_ms"] == pytest.approx(50)
    assert set(row["ratios"]) == {"hit/recompute"}  # nothing to compare the others with
    ratio = row["ratios"]["hit/recompute"]
    assert ratio["ratio"] == pytest.approx(0.1)
    assert (ratio["min"], ratio["max"]) == (pytest.approx(0.05), pytest.approx(0.15))
    assert report["unavailable"] == unavailable

    # in a child: matplotlib keeps its font files open for the life of the process
    (tmp_path / "report.json").write_text(json.dumps(report))
    code = "import json, sys; from pathlib import Path; from kvconnect.bench import vllm_pool; "
    code += "vllm_pool.plot(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])"
    argv = [sys.executable, "-c", code, "report.json", "plot.png"]
    subprocess.run(argv, cwd=tmp_path, check=True, timeout=120)
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
