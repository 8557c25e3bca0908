"""``kvconnect bench pool-load``: the load the vLLM shared prefix pool puts on the store master,
per block, with the same-run baseline of the old key scheme.

A model of ``--layers`` KV layers, ``--chunks`` K/V chunks per layer, at TP ``--tp``: each rank
holds its layers' chunks of a block as ``layers x chunks`` ranges. The **old** scheme stores
each range as its own object (``tp x layers x chunks`` objects per block, every one in the
lookup); the **new** one stores a block as ONE object, each rank writing its ranges as its part
(:meth:`StoreClient.batch_put_gathered`) and reading its part back scattered
(:meth:`StoreClient.batch_get_scattered`), and the lookup asks one key per block. Both run
against the same real master and store server, round by round; every load is checked byte for
byte. Counted: objects the master holds, master RPCs and the keys they name (the master's work
items), per block, for the saves of every rank, the scheduler's lookup, and the loads of every
rank.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvconnect.store import messages as m
from kvconnect.store.client import Span, StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster
from kvconnect.store.rpc import RpcClient
from kvconnect.transfer.memory import MemoryRegion
from kvconnect.vllm.layout import LayerLayout
from kvconnect.vllm.pool import BlockPart, block_part, block_spans

SCHEMES = ("old", "new")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--layers", type=int, default=32, help="KV layers of the model")
    parser.add_argument("--chunks", type=int, default=2, help="K/V chunks per layer")
    parser.add_argument("--tp", type=int, default=2, help="TP ranks (each writes a part)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per request")
    parser.add_argument("--block-bytes", type=int, default=1024, help="bytes per layer chunk")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per scheme (alternating)")
    parser.add_argument("--out", default="bench-pool-load.json")


class _Counting:
    """Counts the master RPCs of a client and the keys they name."""

    def __init__(self, rpc: RpcClient) -> None:
        self._rpc = rpc
        self.rpcs = 0
        self.keys = 0

    def call(self, request: m.Request, timeout: float | None = None) -> m.Reply:
        self.rpcs += 1
        named = getattr(request, "keys", None) or getattr(request, "items", None) or ()
        self.keys += len(named)
        return self._rpc.call(request, timeout)

    def close(self) -> None:
        self._rpc.close()


@dataclass
class _Rank:
    """One TP rank: its client (RPCs counted), its KV memory and its layers."""

    client: StoreClient
    counter: _Counting
    memory: MemoryRegion
    layers: list[LayerLayout]
    part: BlockPart

    def spans(self, block: int) -> list[Span]:
        return block_spans(self.layers, {self.memory.id: self.memory}, block)


def _rank(config: StoreClientConfig, args: argparse.Namespace, rank: int, seed: int) -> _Rank:
    client = StoreClient(config)
    client.start()
    counter = _Counting(client._rpc)  # the bench counts what the client sends the master
    client._rpc = counter  # type: ignore[assignment]
    chunk = args.blocks * args.block_bytes
    layer_bytes = args.chunks * chunk
    data = np.random.default_rng(seed).integers(0, 256, args.layers * layer_bytes, np.uint8)
    memory = client.register(data)
    size = args.block_bytes
    layers = [
        LayerLayout(
            f"layer.{n}", memory.id, n * layer_bytes, args.chunks, chunk, args.blocks, size, size
        )
        for n in range(args.layers)
    ]
    return _Rank(client, counter, memory, layers, block_part(layers, rank, args.tp))


def _old_keys(names: list[str], ranks: range, per_rank: int) -> list[str]:
    """The old scheme's objects of blocks ``names``: one per rank, layer and chunk."""
    return [f"{name}/tp{r}/{i}" for name in names for r in ranks for i in range(per_rank)]


def _save(rank: _Rank, scheme: str, names: list[str], blocks: range) -> bool:
    spans = [rank.spans(block) for block in blocks]
    if scheme == "old":
        keys = _old_keys(names, range(rank.part.part, rank.part.part + 1), len(spans[0]))
        flat = [span for block in spans for span in block]
        result = rank.client.batch_put_from(
            keys, [s.region for s in flat], [s.offset for s in flat], [s.size for s in flat]
        )
    else:
        count = len(names)
        result = rank.client.batch_put_gathered(
            names,
            spans,
            part=rank.part.part,
            parts=rank.part.parts,
            object_sizes=[rank.part.object_bytes] * count,
            object_offsets=[rank.part.object_offset] * count,
        )
    return all(result.ok())


def _lookup(client: StoreClient, scheme: str, names: list[str], ranks: list[_Rank]) -> int:
    if scheme == "old":
        per_block = len(ranks) * len(ranks[0].spans(0))
        found = client.batch_exists(_all_keys(scheme, names, ranks))
        return sum(all(found[n * per_block : (n + 1) * per_block]) for n in range(len(names)))
    return sum(client.batch_exists(names))


def _load(rank: _Rank, scheme: str, names: list[str], target: MemoryRegion) -> bool:
    """Read every block into ``target`` (laid out like the rank's memory) and compare."""
    view = np.frombuffer(target.view, dtype=np.uint8)
    view[:] = 0
    spans = [
        [Span(target, s.offset, s.size) for s in rank.spans(block)] for block in range(len(names))
    ]
    if scheme == "old":
        keys = _old_keys(names, range(rank.part.part, rank.part.part + 1), len(spans[0]))
        flat = [span for block in spans for span in block]
        result = rank.client.batch_get_into(
            keys, [s.region for s in flat], [s.offset for s in flat], [s.size for s in flat]
        )
    else:
        within = [rank.part.object_offset] * len(names)
        result = rank.client.batch_get_scattered(names, spans, object_offsets=within)
    source = np.frombuffer(rank.memory.view, dtype=np.uint8)
    return all(result.ok()) and bool(np.array_equal(view, source))


def _measured(counters: list[_Counting], work: Callable[[], Any]) -> tuple[Any, int, int, float]:
    """``work()``'s result, the RPCs and keys it sent, and its seconds."""
    rpcs, keys = sum(c.rpcs for c in counters), sum(c.keys for c in counters)
    started = time.perf_counter()
    value = work()
    seconds = time.perf_counter() - started
    return (
        value,
        sum(c.rpcs for c in counters) - rpcs,
        sum(c.keys for c in counters) - keys,
        seconds,
    )


def _round(
    scheme: str, n: int, ranks: list[_Rank], scheduler: _Rank, targets: list[MemoryRegion]
) -> dict[str, Any]:
    blocks = range(ranks[0].layers[0].num_blocks)
    names = [f"bench/{scheme}/{n}/block-{b:04d}" for b in blocks]
    before = scheduler.client.stats().keys
    counters = [rank.counter for rank in ranks]
    saved, save_rpcs, save_keys, save_s = _measured(
        counters, lambda: _every([_save(rank, scheme, names, blocks) for rank in ranks])
    )
    objects = scheduler.client.stats().keys - before
    hits, look_rpcs, look_keys, look_s = _measured(
        [scheduler.counter], lambda: _lookup(scheduler.client, scheme, names, ranks)
    )
    loaded, load_rpcs, load_keys, load_s = _measured(
        counters,
        lambda: _every([_load(r, scheme, names, t) for r, t in zip(ranks, targets, strict=True)]),
    )
    if not (saved and loaded and hits == len(names)):
        raise RuntimeError(f"{scheme} round {n}: saved {saved}, hits {hits}, loaded {loaded}")
    count = len(names)
    scheduler.client.batch_remove(_all_keys(scheme, names, ranks), force=True)  # start empty
    return {
        "objects_per_block": objects / count,
        "save_rpcs_per_block": save_rpcs / count,
        "save_keys_per_block": save_keys / count,
        "lookup_rpcs_per_block": look_rpcs / count,
        "lookup_keys_per_block": look_keys / count,
        "load_rpcs_per_block": load_rpcs / count,
        "load_keys_per_block": load_keys / count,
        "save_ms": save_s * 1e3,
        "lookup_ms": look_s * 1e3,
        "load_ms": load_s * 1e3,
    }


def _every(done: list[bool]) -> bool:
    """Every rank did its part (each ran: ``all`` of a generator would stop at the first)."""
    return all(done)


def _all_keys(scheme: str, names: list[str], ranks: list[_Rank]) -> list[str]:
    """Every object of blocks ``names``, of every rank."""
    if scheme == "new":
        return names
    return _old_keys(names, range(len(ranks)), len(ranks[0].spans(0)))


def run(args: argparse.Namespace) -> int:
    """Alternate the schemes ``--rounds`` times; print per-block figures and ratios."""
    per_round = args.tp * args.layers * args.chunks * args.blocks * args.block_bytes
    size = max(64 << 20, 4 * per_round)
    with Cluster(servers=1, server_size=size, master_args=["--master-lease-ttl", "0.2"]) as c:
        config = StoreClientConfig(master=c.master_endpoint, io_timeout=60, rpc_timeout=10)
        ranks = [_rank(config, args, r, seed=r) for r in range(args.tp)]
        scheduler = _rank(config, args, 0, seed=99)
        try:
            targets = [r.client.register(np.zeros(r.memory.length, np.uint8)) for r in ranks]
            rows: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
            for n in range(args.rounds):
                for scheme in SCHEMES:
                    rows[scheme].append(_round(scheme, n, ranks, scheduler, targets))
        finally:
            for rank in (*ranks, scheduler):
                rank.client.close()
    schemes = {s: _medians(rows[s]) for s in SCHEMES}
    report = {
        "benchmark": "pool-load",
        "model": {k: getattr(args, k) for k in ("layers", "chunks", "tp", "blocks", "block_bytes")},
        "schemes": schemes,
        "rounds": dict(rows),
    }
    _print(schemes)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nresults written to {args.out}")
    return 0


def _medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def _print(schemes: dict[str, dict[str, float]]) -> None:
    old, new = schemes["old"], schemes["new"]
    print(f"{'per block (median of rounds)':32} {'old':>10} {'new':>10} {'old/new':>8}")
    for key in old:
        ratio = old[key] / new[key] if new[key] else float("inf")
        print(f"{key:32} {old[key]:10.2f} {new[key]:10.2f} {ratio:8.1f}")
