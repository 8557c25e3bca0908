"""``kvconnect demo``: an all-in-one store and several client processes sharing KV pages.

It starts ``kvconnect serve`` (a master and a store server) and ``--clients`` processes. Each
client plays an inference engine serving conversations: a request's prompt is a chain of pages
— a system prompt all clients share, then its conversation's history. For every request the
client asks which leading pages the store has (``batch_exists``), loads those
(``batch_get_into``, every byte verified), "computes" the rest and stores them
(``batch_put_from``). It prints the hit rate and throughput per client and in total.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Process, free_port
from kvconnect.transfer.memory import MemoryRegion

_OPTIONS = ("clients", "seconds", "page_kib", "store_mib", "conversations", "system_pages")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvconnect demo``."""
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--page-kib", type=int, default=256, help="KV page size")
    parser.add_argument("--store-mib", type=int, default=1024, help="store server memory")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--system-pages", type=int, default=8, help="pages every prompt shares")


def run(args: argparse.Namespace) -> int:
    """Start the store, run the clients, print the results."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    serve = Process(
        ["serve", "--master-listen", endpoint, "--store-size", f"{args.store_mib}M"], "serving"
    )
    try:
        print(serve.banner, flush=True)
        options = {k: getattr(args, k) for k in _OPTIONS}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvconnect.store.demo",
                    endpoint,
                    json.dumps(options | {"seed": n}),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for n in range(args.clients)
        ]
        results = [json.loads(p.communicate(timeout=args.seconds + 120)[0]) for p in procs]
    finally:
        serve.stop()
    _report(results)
    return 0 if all(r["corrupt"] == 0 for r in results) else 1


def _report(results: list[dict[str, Any]]) -> None:
    """Hit rate, and throughput while in store calls (the demo also spends time generating
    and checking page contents, which is not the store's)."""
    heads = ("client", 6), ("requests", 10), ("hit rate", 10), ("store GB/s", 12)
    print("".join(f"{h:>{w}}" for h, w in heads) + f"{'store ms/req':>14}{'corrupt':>9}")
    total = {k: sum(r[k] for r in results) for k in results[0]}
    for name, r in [*((str(n), r) for n, r in enumerate(results)), ("all", total)]:
        hit = r["hits"] / max(1, r["pages"])
        rate = (r["read"] + r["written"]) / (max(r["ns"], 1) / 1e9) / 1e9
        per_request = r["ns"] / 1e6 / max(1, r["requests"])
        print(
            f"{name:>6}{r['requests']:>10}{hit:>10.1%}{rate:>12.2f}"
            f"{per_request:>14.2f}{r['corrupt']:>9}"
        )


def _page_key(chain: list[str]) -> str:
    """A page's key hashes the whole prefix up to it, as engines key KV pages."""
    return hashlib.sha256("/".join(chain).encode()).hexdigest()


def _client(endpoint: str, options: dict[str, Any]) -> dict[str, int]:
    rng = random.Random(options["seed"])
    page = options["page_kib"] * 1024
    stats = {"requests": 0, "pages": 0, "hits": 0, "read": 0, "written": 0, "corrupt": 0, "ns": 0}
    histories = {c: rng.randint(0, 8) for c in range(options["conversations"])}
    with StoreClient(StoreClientConfig(master=endpoint)) as client:
        max_pages = options["system_pages"] + 64
        buffer = client.register(np.zeros(max_pages * page, dtype=np.uint8))
        end = time.monotonic() + options["seconds"]
        while time.monotonic() < end:
            conversation = rng.randrange(options["conversations"])
            histories[conversation] = min(histories[conversation] + rng.randint(1, 3), 64)
            chain = [f"system-{i}" for i in range(options["system_pages"])]
            chain += [f"conv-{conversation}-turn-{t}" for t in range(histories[conversation])]
            keys = [_page_key(chain[: i + 1]) for i in range(len(chain))]
            _serve_request(client, buffer, keys, page, stats)
    return stats


def _serve_request(
    client: StoreClient, buffer: MemoryRegion, keys: list[str], page: int, stats: dict[str, int]
) -> None:
    offsets = [i * page for i in range(len(keys))]
    start = time.perf_counter_ns()
    found = client.batch_exists(keys)
    hits = next((i for i, f in enumerate(found) if not f), len(keys))
    if hits:
        result = client.batch_get_into(keys[:hits], buffer, offsets[:hits], [page] * hits)
        hits = result.leading()  # use what arrived; recompute the rest
    stats["ns"] += time.perf_counter_ns() - start
    if hits:
        for key, off in zip(keys[:hits], offsets, strict=False):
            if buffer.view[off : off + page] != _value(key, page).data:
                stats["corrupt"] += 1
        stats["read"] += hits * page
    missing = keys[hits:]
    for key, off in zip(missing, offsets[hits:], strict=True):
        buffer.view[off : off + page] = _value(key, page).data  # "compute" the page
    if missing:
        start = time.perf_counter_ns()
        client.batch_put_from(missing, buffer, offsets[hits:], [page] * len(missing))
        stats["ns"] += time.perf_counter_ns() - start
        stats["written"] += len(missing) * page
    stats["requests"] += 1
    stats["pages"] += len(keys)
    stats["hits"] += hits


def _value(key: str, page: int) -> np.ndarray:
    """A page's bytes, pseudo-random from its key: any client can verify any page."""
    rng = np.random.default_rng(int(key[:16], 16))
    return np.frombuffer(rng.bytes(page), dtype=np.uint8)


if __name__ == "__main__":
    print(json.dumps(_client(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
