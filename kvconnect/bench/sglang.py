"""``kvconnect bench sglang``: SGLang HiCache's L3 backends through SGLang's own controller.

Runs in SGLang's environment (``./dev.sh bench sglang``). For each backend, SGLang's real
``HybridCacheController`` over a real MHA host pool on CPU (``page_first``, ~1 MiB pages by
default) backs pages up to L3 and prefetches them back, driven as SGLang's scheduler drives it.
The backends, each with its own host pool holding the same bytes, take turns round by round
(the order alternating):

* ``kvconnect``: a master and two store-server processes (:mod:`kvconnect.store.launch`), the
  client forced to tcp; ``kvconnect-shm``: the same cluster through shared memory (``auto``,
  the default on one host; another key namespace);
* ``mooncake``: SGLang's own ``mooncake`` backend on Mooncake Store (the
  ``mooncake-transfer-engine-non-cuda`` wheel): a master and two holder processes
  (``mooncake_store_runner.py --role servers``); the client here mounts no memory, so every
  byte crosses Mooncake's TCP transport;
* ``file``: SGLang's ``file`` backend on a directory (tmpfs by default).

Phases:

* **throughput**: per round, fresh pages (new token ids) are backed up, the host copy is
  dropped, and they are prefetched back; whole-operation pages/s and GB/s (backup: queued to
  ack; prefetch: host slots given to the final ack, the hit query excluded) and per-batch
  p50/p99 of SGLang's storage batches (``page_set_func``/``page_get_func`` timed). One warm-up
  round per backend is not counted; after it the process's heap is collected and frozen once
  (as a warmed-up SGLang server's ``freeze_gc``).
* **stall**: pages written, then one store process is SIGSTOPped when the prefetch's first
  read batch ends (mid-prefetch, in SGLang's prefetch thread); SGLang's ``timeout`` policy
  terminates the prefetch at its budget (``prefetch_timeout_base + per_ki_token * tokens``,
  SGLang's defaults) unless it finished; the fraction reused is the tokens completed by then
  over the hit. ``file`` has no server.

Every prefetched page is compared with what was written (BLAKE2b per page); a mismatch, a short
backup or a short prefetch outside the stall phase stops the run.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import queue
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvconnect.bench import usage
from kvconnect.bench.baselines import mooncake_store
from kvconnect.sglang.plugin import DYNAMIC_ROUTE
from kvconnect.store.launch import Cluster

STORAGE_BATCH = 128  # pages per backend call: SGLang's STORAGE_BATCH_SIZE
ACK_TIMEOUT = 120.0
TIMEOUT_BASE, TIMEOUT_PER_KI_TOKEN = 1.0, 0.25  # SGLang's prefetch budget defaults
DEVICE_TOKENS = 256  # the device pool is a stand-in: the storage path never touches it
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    """The model's KV geometry: a page is ``2 * layers * tokens * heads * head_dim`` values."""

    layers: int = 16
    heads: int = 8
    head_dim: int = 128
    page_tokens: int = 16

    @property
    def page_bytes(self) -> int:
        return 2 * self.layers * self.page_tokens * self.heads * self.head_dim * DTYPE.itemsize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvconnect bench sglang``."""
    parser.add_argument("--systems", default="kvconnect,kvconnect-shm,mooncake,file")
    parser.add_argument("--pages", type=int, default=256, help="pages per round")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds per backend")
    parser.add_argument("--stall-rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=Shape.layers)
    parser.add_argument("--heads", type=int, default=Shape.heads)
    parser.add_argument("--head-dim", type=int, default=Shape.head_dim)
    parser.add_argument("--page-tokens", type=int, default=Shape.page_tokens)
    parser.add_argument(
        "--file-dir",
        default="/dev/shm",  # noqa: S108  # tmpfs; the backend's own dir inside is private
        help="parent of the file backend's directory (default tmpfs)",
    )
    parser.add_argument("--out", default="bench-sglang.json")
    parser.add_argument("--plot", nargs="?", const="bench-sglang.png", help="write a PNG chart")


def run(args: argparse.Namespace) -> int:
    """Run both phases on the chosen backends; print tables; write the JSON report."""
    shape = Shape(args.layers, args.heads, args.head_dim, args.page_tokens)
    names = args.systems.split(",")
    with ExitStack() as stack:
        systems = _start(stack, names, shape, args)
        report: dict[str, Any] = {
            "benchmark": "sglang",
            "shape": {**vars(shape), "page_bytes": shape.page_bytes},
            "pages": args.pages,
            "rounds": args.rounds,
            "throughput": _throughput(systems, shape, args.pages, args.rounds),
        }
        stall = _stalls(systems, shape, args.pages, args.stall_rounds) if args.stall_rounds else {}
        report["stall"] = stall
        report["verified_pages"] = {s.name: s.verified_pages for s in systems}
    report["ratios"] = _ratios(report["throughput"])
    _print(report)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nresults written to {args.out}")
    if args.plot:
        plot(report, args.plot)
        print(f"plot written to {args.plot}")
    return 0


# ------------------------------------------------------------------- SGLang's controller


def _sglang_process() -> None:
    """This process plays one rank: SGLang's collectives become no-ops."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )


def host_pool(shape: Shape, pages: int, layout: str = "page_first") -> Any:
    """A real MHA host pool of ``pages`` pages in ordinary (unpinned) memory."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    def layers() -> tuple[torch.Tensor, ...]:
        size = (DEVICE_TOKENS, shape.heads, shape.head_dim)
        return tuple(torch.zeros(size, dtype=DTYPE) for _ in range(shape.layers))

    k, v = layers(), layers()
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k,
            v=v,
            k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
            v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
            layout=KVBufferLayout.NHD,
        ),
        page_size=shape.page_tokens,
        head_num=shape.heads,
        head_dim=shape.head_dim,
        v_head_dim=shape.head_dim,
        dtype=DTYPE,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=shape.page_tokens,
        layout=layout,
        pin_memory=False,  # pinning needs a CUDA driver
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=shape.layers - 1,
        host_token_capacity=pages * shape.page_tokens,
    )


class DevicePool:
    """The device-pool surface the controller's constructor touches."""

    def __init__(self, layers: int) -> None:
        self.device = torch.device("cpu")
        self.layer_num = layers
        self.start_layer = 0
        self.end_layer = layers - 1

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.layer_transfer_counter = counter


class Allocator:
    """The allocator surface the controller's constructor touches: its device pool."""

    def __init__(self, device_pool: DevicePool) -> None:
        self._pool = device_pool

    def get_kvcache(self) -> DevicePool:
        return self._pool


def controller(pool: Any, shape: Shape, backend: str, extra: dict[str, Any]) -> Any:
    """SGLang's production cache controller over ``pool`` with ``backend`` attached."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
    )
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry

    device = DevicePool(shape.layers)
    entry = PoolEntry(
        name=PoolName.KV,
        host_pool=pool,
        device_pool=device,
        layer_mapper=lambda i: i,
        is_primary_index_anchor=True,
    )
    return HybridCacheController(
        Allocator(device),
        HostPoolGroup([entry]),
        transfer_layer_id_max=shape.layers,
        page_size=shape.page_tokens,
        tp_group=None,
        load_cache_event=threading.Event(),
        write_policy="write_through",
        io_backend="direct",
        storage_backend=backend,
        prefetch_threshold=shape.page_tokens,
        model_name="bench/model",
        storage_backend_extra_config=extra,
    )


@dataclass
class System:
    """One backend under its own controller and host pool; per-batch seconds are recorded."""

    name: str
    cc: Any
    pool: Any
    server_pids: tuple[int, ...] = ()  # the store's processes, for CPU accounting
    stall: Callable[[], None] | None = None  # SIGSTOP one store process
    resume: Callable[[], None] | None = None
    batches: dict[str, list[float]] = field(default_factory=lambda: {"set": [], "get": []})
    verified_pages: int = 0  # prefetched pages found equal to what was written
    stall_after_batch: bool = False  # stop a store process once the next read batch ends
    stalled: bool = False

    def __post_init__(self) -> None:
        self.cc.page_set_func = self._timed(self.cc.page_set_func, "set")
        self.cc.page_get_func = self._timed(self.cc.page_get_func, "get")

    def _timed(self, func: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return func(*args)
            finally:
                self.batches[kind].append(time.perf_counter() - start)
                if kind == "get" and self.stall_after_batch and self.stall is not None:
                    # in SGLang's prefetch thread, between two batches: the same point of
                    # the prefetch for every backend, however fast it is
                    self.stall_after_batch = False
                    self.stall()
                    self.stalled = True

        return timed

    def ready(self) -> None:
        """Wait until the backend uses its store again (kvconnect's breaker after a stall)."""
        backend = self.cc.storage_backend
        deadline = time.monotonic() + 60
        while getattr(backend, "local_only", False):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: the store did not come back")
            backend.batch_exists(["probe"])  # after the cooldown this is the breaker's probe
            time.sleep(0.05)

    def close(self) -> None:
        self.cc.detach_storage_backend()


def _start(
    stack: ExitStack, names: list[str], shape: Shape, args: argparse.Namespace
) -> list[System]:
    """Every backend of ``names`` under its own controller; ``stack`` stops them."""
    _sglang_process()
    # Nothing is removed between rounds (Mooncake's remove_all spares leased objects): each
    # store's two processes have room for 1.5 times every round of its systems, so no store
    # evicts. 64 MiB more: Mooncake refuses tiny segments.
    data = (args.rounds + 1 + args.stall_rounds) * args.pages * shape.page_bytes
    kvconnect_systems = sum(1 for name in names if name.startswith("kvconnect"))
    systems = []
    cluster: Cluster | None = None
    for name in names:
        pool = host_pool(shape, args.pages + 2 * STORAGE_BATCH)
        if name.startswith("kvconnect"):
            if cluster is None:
                size = _per_process(data * kvconnect_systems)
                cluster = stack.enter_context(Cluster(servers=2, server_size=size))
            transport = "auto" if name == "kvconnect-shm" else "tcp"
            extra = _kvconnect_extra(cluster.master_endpoint, transport, name)
            pids = (cluster.master.pid, *(s.pid for s in cluster.servers))
            system = System(name, controller(pool, shape, "dynamic", extra), pool, pids)
            server = cluster.servers[1]
            system.stall = lambda s=server: s.signal(signal.SIGSTOP)
            system.resume = lambda s=server: s.signal(signal.SIGCONT)
        elif name == "mooncake":
            servers = stack.enter_context(
                mooncake_store.store_servers(sys.executable, _per_process(data), holders=2)
            )
            extra = _mooncake_extra(servers)
            pids = (servers["master_pid"], *servers["holders"])
            system = System(name, controller(pool, shape, "mooncake", extra), pool, pids)
            pid = servers["holders"][1]
            system.stall = lambda p=pid: os.kill(p, signal.SIGSTOP)
            system.resume = lambda p=pid: os.kill(p, signal.SIGCONT)
        elif name == "file":
            directory = stack.enter_context(tempfile.TemporaryDirectory(dir=args.file_dir))
            extra = {"file_storage_path": directory}
            system = System(name, controller(pool, shape, "file", extra), pool)
        else:
            raise SystemExit(f"unknown system {name!r}")
        stack.callback(system.close)
        systems.append(system)
    return systems


def _per_process(data: int) -> int:
    """Bytes for each of a store's two processes to hold ``data`` with room to spare."""
    return int(data * 0.75) + (64 << 20)


def _kvconnect_extra(master: str, transport: str, namespace: str) -> dict[str, Any]:
    """SGLang's ``dynamic`` route to kvconnect with the zero-copy interface."""
    return {
        **DYNAMIC_ROUTE,
        "master": master,
        "transport": transport,
        "namespace": namespace,
    }


def _mooncake_extra(servers: dict[str, Any]) -> dict[str, Any]:
    """SGLang's mooncake backend as a pure client (no segment of its own), over TCP."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    return {
        "master_server_address": servers["master"],
        "metadata_server": servers["metadata"],
        "global_segment_size": 0,
        "protocol": "tcp",
        "device_name": "",
        "local_hostname": "127.0.0.1",
        "check_server": False,
    }


# ---------------------------------------------------------------------------- one round


@dataclass
class Pages:
    """One round's pages: token ids, SGLang's page hashes, bytes and their digests."""

    tokens: list[int]
    hashes: list[str]
    data: torch.Tensor  # uint8, one row per page
    digests: list[bytes]


def _pages(shape: Shape, count: int, seed: int) -> Pages:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    start = 1000 + seed * 10_000_000
    tokens = list(range(start, start + count * shape.page_tokens))
    # numpy's generator runs on this thread alone; torch's randint runs on OpenMP workers,
    # which a profile showed spin-waiting on the two cores the timed transfers need
    raw = bytearray(np.random.default_rng(seed).bytes(count * shape.page_bytes))
    data = torch.frombuffer(raw, dtype=torch.uint8).view(count, shape.page_bytes)
    hashes = list(get_storage_hash_str(tokens, None, page_size=shape.page_tokens))
    return Pages(tokens, hashes, data, [_digest(row) for row in data])


def _digest(page: torch.Tensor) -> bytes:
    return hashlib.blake2b(page.numpy().data, digest_size=16).digest()


def _page_starts(system: System, host_indices: torch.Tensor) -> list[int]:
    return [int(host_indices[i]) for i in range(0, len(host_indices), system.cc.page_size)]


def _read_digests(system: System, host_indices: torch.Tensor, count: int) -> list[bytes]:
    """Digests of the first ``count`` pages at ``host_indices`` (SGLang's flat page bytes)."""
    starts = _page_starts(system, host_indices)[:count]
    return [_digest(system.pool.get_data_page(i).view(torch.uint8)) for i in starts]


@dataclass
class Timed:
    seconds: float
    cpu_seconds: float  # this process and the store's, over the same span


def _backup(system: System, pages: Pages) -> Timed:
    """Write the pages through the controller's backup thread, timed to its ack."""
    source = system.pool.alloc(len(pages.tokens))
    for index, row in zip(_page_starts(system, source), pages.data, strict=True):
        system.pool.set_from_flat_data_page(index, row.view(DTYPE))
    start, cpu = time.perf_counter(), usage.cpu_seconds(system.server_pids)
    system.cc.write_storage(source, pages.tokens, hash_value=pages.hashes)
    ack = system.cc.ack_backup_queue.get(timeout=ACK_TIMEOUT)
    timed = Timed(time.perf_counter() - start, usage.cpu_seconds(system.server_pids) - cpu)
    system.pool.free(source)  # L1/L2 dropped: only L3 has the pages now
    if int(ack.completed_tokens) != len(pages.tokens):
        raise RuntimeError(f"{system.name}: backup stored {ack.completed_tokens} tokens")
    return timed


@dataclass
class Prefetch:
    hit_pages: int
    reused_pages: int  # what the scheduler takes: completed at termination, or in all
    timed: Timed  # host slots given to the final ack
    intact: bool  # every reused page equals what was written


def _prefetch(system: System, pages: Pages, rid: str, *, stall: bool = False) -> Prefetch:
    """A prefetch as SGLang's scheduler runs it under the ``timeout`` policy; with ``stall``,
    one store process is stopped when the first read batch ends and resumed when the
    scheduler has taken its pages (or at the end)."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

    cc, page = system.cc, system.cc.page_size
    operation = cc.prefetch(CacheRequestHandle(rid=rid, attempt_id=0), pages.tokens)
    if cc.prefetch_hit_queue.get(timeout=ACK_TIMEOUT) is not operation:
        raise RuntimeError(f"{system.name}: another prefetch answered")
    hit = int(operation.storage_hit_count)
    if hit == 0:
        return Prefetch(0, 0, Timed(0.0, 0.0), True)
    host_indices = cc.alloc_prefetch_host_buffers(operation, hit)
    operation.host_indices = host_indices
    operation.hash_value = operation.hash_value[: len(host_indices) // page]
    budget = TIMEOUT_BASE + TIMEOUT_PER_KI_TOKEN * hit / 1024
    start, cpu = time.perf_counter(), usage.cpu_seconds(system.server_pids)
    system.stall_after_batch = stall
    cc.prefetch_buffer.put(operation)
    taken: int | None = None
    try:
        while True:
            wait = ACK_TIMEOUT if taken is not None else budget - (time.perf_counter() - start)
            try:
                ack = cc.ack_prefetch_queue.get(timeout=max(wait, 0.0))
            except queue.Empty:
                taken, _ = cc.terminate_prefetch(operation)  # SGLang's timeout policy
                _resume(system)
                continue
            if ack.completed_tokens is not None and taken is None:
                operation.completed_tokens = int(ack.completed_tokens)
            if ack.completed_req:
                break
    finally:
        system.stall_after_batch = False
        _resume(system)
    timed = Timed(time.perf_counter() - start, usage.cpu_seconds(system.server_pids) - cpu)
    reused = (taken if taken is not None else int(operation.completed_tokens)) // page
    intact = _read_digests(system, host_indices, reused) == pages.digests[:reused]
    system.verified_pages += reused if intact else 0
    cc.mem_pool_host.free(host_indices)
    return Prefetch(hit // page, reused, timed, intact)


def _resume(system: System) -> None:
    if system.stalled and system.resume is not None:
        system.resume()
        system.stalled = False


# ---------------------------------------------------------------------------- phases


def _throughput(
    systems: list[System], shape: Shape, count: int, rounds: int
) -> dict[str, dict[str, Any]]:
    samples: dict[str, dict[str, list[Timed]]] = {
        s.name: {"backup": [], "prefetch": []} for s in systems
    }
    for n in range(rounds + 1):  # round 0 warms every backend up and is not counted
        if n == 1:
            _freeze_gc()
        pages = _pages(shape, count, seed=n)
        order = systems if n % 2 == 0 else list(reversed(systems))
        for system in order:
            print(f"[throughput] {system.name} round {n}/{rounds}", file=sys.stderr, flush=True)
            system.ready()
            backup = _backup(system, pages)
            result = _prefetch(system, pages, f"{system.name}-t{n}")
            if result.reused_pages != count or not result.intact:
                raise RuntimeError(f"{system.name}: prefetch returned {result}")
            if n == 0:
                for batches in system.batches.values():
                    batches.clear()
            else:
                samples[system.name]["backup"].append(backup)
                samples[system.name]["prefetch"].append(result.timed)
    return {
        s.name: {
            op: _summary(samples[s.name][op], s.batches[kind], count, shape.page_bytes)
            for op, kind in (("backup", "set"), ("prefetch", "get"))
        }
        for s in systems
    }


def _freeze_gc() -> None:
    """Collect once and exempt the survivors from later collections, as SGLang's
    ``freeze_gc`` request does after a server's warm-up. Without it, this process's first
    full collection of its start-up heap (SGLang, torch: 0.35-0.40 s here) stops whichever
    backend's storage batch happens to allocate the object that triggers it."""
    gc.collect()
    gc.freeze()


def _summary(
    rounds: list[Timed], batches: list[float], count: int, page_bytes: int
) -> dict[str, Any]:
    flat = sorted(batches)
    rates = [count / r.seconds for r in rounds]
    gigabytes = count * page_bytes / 1e9
    return {
        # CPU seconds (client and store processes together) per GB moved
        "cpu_s_per_gb": statistics.median(r.cpu_seconds / gigabytes for r in rounds),
        "pages_per_s": statistics.median(rates),
        "pages_per_s_rounds": rates,
        "gbps": statistics.median(rates) * page_bytes / 1e9,
        "batch_p50_ms": statistics.median(flat) * 1e3,
        "batch_p99_ms": flat[min(len(flat) - 1, int(len(flat) * 0.99))] * 1e3,
        "batches": len(flat),
    }


def _stalls(
    systems: list[System], shape: Shape, count: int, rounds: int
) -> dict[str, dict[str, Any] | None]:
    reused: dict[str, list[float]] = {s.name: [] for s in systems if s.stall is not None}
    seconds: dict[str, list[float]] = {name: [] for name in reused}
    for n in range(rounds):
        pages = _pages(shape, count, seed=1000 + n)
        stallable = [s for s in systems if s.stall is not None]
        for system in stallable if n % 2 == 0 else list(reversed(stallable)):
            print(f"[stall] {system.name} round {n + 1}/{rounds}", file=sys.stderr, flush=True)
            system.ready()
            _backup(system, pages)
            result = _prefetch(system, pages, f"{system.name}-s{n}", stall=True)
            if not result.intact or result.hit_pages != count:
                raise RuntimeError(f"{system.name}: stalled prefetch returned {result}")
            reused[system.name].append(result.reused_pages / result.hit_pages)
            seconds[system.name].append(result.timed.seconds)
    report: dict[str, dict[str, Any] | None] = {s.name: None for s in systems}
    for name, fractions in reused.items():
        report[name] = {
            "reused_fraction": statistics.median(fractions),
            "reused_fraction_rounds": fractions,
            "seconds_rounds": seconds[name],
        }
    return report


def _ratios(throughput: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """kvconnect's prefetch and backup pages/s over each baseline's: ratio of medians, and the
    spread of the per-round ratios (rounds are paired: the same pages, back to back)."""
    ratios: dict[str, dict[str, Any]] = {}
    ours = {n: r for n, r in throughput.items() if n.startswith("kvconnect")}
    theirs = {n: r for n, r in throughput.items() if not n.startswith("kvconnect")}
    for mine, my_result in ours.items():
        for other, other_result in theirs.items():
            row = {}
            for op in ("prefetch", "backup"):
                paired = [
                    a / b
                    for a, b in zip(
                        my_result[op]["pages_per_s_rounds"],
                        other_result[op]["pages_per_s_rounds"],
                        strict=True,
                    )
                ]
                row[op] = {
                    "ratio": my_result[op]["pages_per_s"] / other_result[op]["pages_per_s"],
                    "min": min(paired),
                    "max": max(paired),
                }
            ratios[f"{mine}/{other}"] = row
    return ratios


# ---------------------------------------------------------------------------- output


def _print(report: dict[str, Any]) -> None:
    shape = report["shape"]
    print(
        f"\n{report['pages']} pages of {shape['page_bytes'] / (1 << 20):.2f} MiB per round, "
        f"{report['rounds']} rounds"
    )
    head = f"{'backend':<15}{'op':<10}{'pages/s':>9}{'(rounds min-max)':>18}{'GB/s':>7}"
    print(head + f"{'p50 ms':>9}{'p99 ms':>9}{'CPU s/GB':>10}{'reused (stall)':>16}")
    for name, ops in report["throughput"].items():
        for op, row in ops.items():
            cell = "-"
            if op == "prefetch" and name in report["stall"]:
                stall = report["stall"][name]
                cell = "no server" if stall is None else f"{stall['reused_fraction']:.2f}"
            spread = f"{min(row['pages_per_s_rounds']):.0f}-{max(row['pages_per_s_rounds']):.0f}"
            print(
                f"{name:<15}{op:<10}{row['pages_per_s']:>9.0f}{spread:>18}{row['gbps']:>7.2f}"
                f"{row['batch_p50_ms']:>9.1f}{row['batch_p99_ms']:>9.1f}"
                f"{row['cpu_s_per_gb']:>10.2f}{cell:>16}"
            )
    print()
    for pair, row in report["ratios"].items():
        cells = [f"{op} {r['ratio']:.2f}x ({r['min']:.2f}-{r['max']:.2f})" for op, r in row.items()]
        print(f"{pair:<26}" + "   ".join(cells))


def plot(report: dict[str, Any], path: str) -> None:
    """Bars of backup and prefetch GB/s per backend, and the reused fraction under a stall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["throughput"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.4
    for n, op in enumerate(("backup", "prefetch")):
        values = [report["throughput"][name][op]["gbps"] for name in names]
        left.bar([i + n * width for i in range(len(names))], values, width, label=op)
    left.set_xticks([i + width / 2 for i in range(len(names))])
    left.set_xticklabels(names)
    left.set_ylabel("GB/s (median of rounds)")
    left.set_title("through SGLang's HiCache controller")
    left.legend()
    stalled = {n: r for n, r in report["stall"].items() if r is not None}
    right.bar(list(stalled), [r["reused_fraction"] for r in stalled.values()])
    right.set_ylim(0, 1)
    right.set_ylabel("fraction of hit pages reused")
    right.set_title("one store process SIGSTOPped mid-prefetch")
    fig.suptitle("kvconnect bench sglang")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
