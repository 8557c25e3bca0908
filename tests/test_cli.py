"""The console script and the examples, run as users run them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _kvconnect(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvconnect.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )


# What a server command (or the demo, a shipped job) may not load: benchmarks, test helpers,
# engines, torch.
_HEAVY = ("kvconnect.bench", "kvconnect.testing", "torch", "sglang", "vllm")
_MODULES_AFTER = """
import contextlib, io, sys
from kvconnect.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    main(sys.argv[1:])
print("\\n".join(sorted(sys.modules)))
"""


@pytest.mark.parametrize("command", ["master", "store", "demo", "router"])
def test_server_commands_load_no_benchmarks_test_helpers_or_torch(
    command: str, tmp_path: Path
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _MODULES_AFTER, command, "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    modules = out.splitlines()
    assert "kvconnect.cli" in modules  # the listing is of a process that ran the CLI
    heavy = [m for m in modules for h in _HEAVY if m == h or m.startswith(f"{h}.")]
    assert not heavy, f"kvconnect {command} --help imported {heavy}"


def test_help_lists_subcommands(tmp_path: Path) -> None:
    out = _kvconnect("--help", cwd=tmp_path).stdout
    assert "bench" in out
    assert "transfer" in _kvconnect("bench", "--help", cwd=tmp_path).stdout


@pytest.mark.slow
@pytest.mark.integration
def test_bench_transfer_reports_kvconnect_and_baselines(tmp_path: Path) -> None:
    _kvconnect(
        "bench",
        "transfer",
        "--quick",
        "--cases",
        "64K:16,1M:4",
        "--baselines",
        "socket,memcpy",
        "--out",
        "result.json",
        "--plot",
        "chart.png",
        cwd=tmp_path,
    )
    report = json.loads((tmp_path / "result.json").read_text())
    cases = {(r["transport"], r["op"], r["block"]) for r in report["results"]}
    assert cases == {
        (t, op, block)
        for t in ("tcp", "shm")
        for op in ("read", "write")
        for block in (65536, 1 << 20)
    }
    for result in report["results"]:
        assert result["kvconnect"]["gbps"] > 0
        baseline = "socket" if result["transport"] == "tcp" else "memcpy"
        summary = result["baselines"][baseline]
        assert summary["ratio"] == pytest.approx(result["kvconnect"]["gbps"] / summary["gbps"])
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_bench_pool_load_counts_one_object_per_block_against_the_old_scheme(
    tmp_path: Path,
) -> None:
    args = ("--layers", "4", "--tp", "2", "--blocks", "8", "--rounds", "1", "--out", "r.json")
    _kvconnect("bench", "pool-load", *args, cwd=tmp_path)
    schemes = json.loads((tmp_path / "r.json").read_text())["schemes"]
    assert schemes["old"]["objects_per_block"] == 2 * 4 * 2  # ranks x layers x K/V
    assert schemes["new"]["objects_per_block"] == 1
    assert schemes["old"]["lookup_keys_per_block"] == 16
    assert schemes["new"]["lookup_keys_per_block"] == 1
    assert schemes["new"]["save_rpcs_per_block"] == schemes["old"]["save_rpcs_per_block"]


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_example_two_peers_runs(transport: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "transfer_two_peers.py"),
            "--transport",
            transport,
            "--mib",
            "16",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "READ  16 MiB" in out
    assert "WRITE 16 MiB" in out
