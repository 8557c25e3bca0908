"""SGLang's real HiCache controller and host KV pools, driven on a CPU.

The production controller (``HybridCacheController`` over a ``HostPoolGroup``, as SGLang's
radix cache builds it) runs its own backup, prefetch and ack threads; these helpers play the
scheduler's side: queue a backup and wait for its ack; queue a prefetch, give it host slots
for the hit, and collect the acks as the scheduler would. The device side is a stand-in: the
storage path never touches it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.device_pool_info import (
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import create_context, use_context
from sglang.srt.server_args import ServerArgs, prepare_server_args

from kvconnect.bench import sglang as bench
from kvconnect.bench.tiny_llama import write_tiny_llama
from kvconnect.sglang.plugin import DYNAMIC_ROUTE
from kvconnect.transfer import TransferOp
from kvconnect.transfer.batch import Slice
from kvconnect.transfer.datapath.copying import Copier, CopyWorkers

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 8, 16
MLA_WIDTH = 24  # kv_lora_rank 16 + rope 8
DTYPE = torch.bfloat16
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * DTYPE.itemsize  # K and V of one MHA page
DEVICE_TOKENS = 256
ACK_TIMEOUT = 60.0
_VERDICT_POLL = 0.005  # seconds between two looks at a verdict while acks are awaited


def mha_pool(
    layout: str = "page_first", pages: int = 800, heads: int = HEADS
) -> MHATokenToKVPoolHost:
    """A real MHA host pool in ordinary (unpinned) memory, of one rank's ``heads`` KV heads."""
    return bench.host_pool(bench.Shape(LAYERS, heads, HEAD_DIM, PAGE), pages, layout)


def mla_pool(layout: str = "page_first", pages: int = 200) -> MLATokenToKVPoolHost:
    """A real MLA host pool in ordinary memory."""
    buffers = tuple(torch.zeros(DEVICE_TOKENS, 1, MLA_WIDTH, dtype=DTYPE) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=buffers,
        data_ptrs=torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS,
        page_size=PAGE,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        kv_cache_dim=MLA_WIDTH,
        dtype=DTYPE,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS - 1,
        target_layer_num=LAYERS,
        host_token_capacity=pages * PAGE,
    )


class _MLADevicePool(bench.DevicePool, MLATokenToKVPool):
    """A stand-in MLA device pool: the controller tells MLA models (one copy of each page for
    all ranks) by the device pool's class."""


def controller(
    host_pool: Any,
    backend: str | None,
    extra_config: dict[str, Any],
    model: str = "test/model",
    sidecars: Mapping[PoolName, Any] | None = None,
    *,
    mla: bool = False,
    enable_storage_metrics: bool = False,
) -> HybridCacheController:
    """SGLang's production cache controller with ``backend`` attached (its threads run;
    ``None``: no storage backend, as a server started without L3). ``sidecars``: a hybrid
    model's other host pools, by name (the KV pool is the anchor); ``mla``: the model is an
    MLA model; ``enable_storage_metrics`` as SGLang's ``--enable-metrics`` sets it."""
    device = _MLADevicePool(LAYERS) if mla else bench.DevicePool(LAYERS)
    entries = [
        PoolEntry(
            name=PoolName.KV,
            host_pool=host_pool,
            device_pool=device,
            layer_mapper=lambda i: i,
            is_primary_index_anchor=True,
        )
    ]
    for name, pool in (sidecars or {}).items():
        entries.append(
            PoolEntry(name=name, host_pool=pool, device_pool=device, layer_mapper=lambda i: i)
        )
    group = HostPoolGroup(entries)
    return HybridCacheController(
        bench.Allocator(device),
        group,
        transfer_layer_id_max=LAYERS,
        page_size=PAGE,
        tp_group=None,  # one rank: the collectives are no-ops
        load_cache_event=threading.Event(),
        write_policy="write_through",
        io_backend="direct",
        storage_backend=backend,
        prefetch_threshold=PAGE,
        model_name=model,
        storage_backend_extra_config=dict(extra_config),
        enable_storage_metrics=enable_storage_metrics,
    )


def dynamic(extra_config: dict[str, Any]) -> dict[str, Any]:
    """``extra_config`` for the no-patch route: SGLang's ``dynamic`` loader with the
    zero-copy interface."""
    return {**DYNAMIC_ROUTE, **extra_config}


def rank_storage(master: str, rank: int, mla: bool, **extra: Any) -> HiCacheStorageConfig:
    """The storage config SGLang gives the backend on TP rank ``rank`` of 2 (MLA or not)."""
    return HiCacheStorageConfig(
        tp_rank=rank,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="ranks/model",
        extra_config={"master": master, **extra},
    )


def tokens_for(pages: int, seed: int = 0) -> list[int]:
    """Token ids of ``pages`` pages (distinct per seed)."""
    start = 1000 + seed * 1_000_000
    return list(range(start, start + pages * PAGE))


def page_hashes(tokens: list[int]) -> list[str]:
    """SGLang's own chained page hashes of ``tokens``."""
    return list(get_storage_hash_str(tokens, None, page_size=PAGE))


def fill(host_pool: Any, host_indices: torch.Tensor, seed: int) -> None:
    """Random page contents (reproducible by seed)."""
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, len(host_indices), PAGE):
        page = host_pool.get_data_page(int(host_indices[start]), flat=False)
        page.copy_(torch.randn(page.shape, generator=generator).to(DTYPE))


def pages_of(host_pool: Any, host_indices: torch.Tensor) -> list[bytes]:
    """The bytes of each page at ``host_indices``."""
    return [
        host_pool.get_data_page(int(host_indices[start])).view(torch.uint8).numpy().tobytes()
        for start in range(0, len(host_indices), PAGE)
    ]


def backup(
    cc: HybridCacheController,
    host_indices: torch.Tensor,
    tokens: list[int],
    hashes: list[str] | None = None,
    extra_pools: list[PoolTransfer] | None = None,
) -> int:
    """Write pages to L3 through the controller's backup thread; tokens it acknowledged.
    ``hashes``: the pages' hashes when ``tokens`` continue an earlier sequence;
    ``extra_pools``: the sidecar pools' transfers, as SGLang's radix cache builds them."""
    cc.write_storage(
        host_indices, tokens, hash_value=hashes or page_hashes(tokens), extra_pools=extra_pools
    )
    operation = cc.ack_backup_queue.get(timeout=ACK_TIMEOUT)
    return int(operation.completed_tokens)


@dataclass
class Prefetch:
    """What one prefetch did, as the scheduler sees it."""

    hit_tokens: int
    completed_tokens: int
    host_indices: torch.Tensor | None
    seconds: float  # from the hit to the final ack
    terminated: bool = False  # SGLang's verdict came before the final ack
    read_tokens: int = 0  # what the IO thread acknowledged last (after a verdict too)
    pool_hits: dict[str, int] | None = None  # the sidecar pools' pages read (hybrid models)


def prefetch(
    cc: HybridCacheController,
    rid: str,
    tokens: list[int],
    *,
    stop_after: float | None = None,
    before_read: Callable[[torch.Tensor], None] | None = None,
    verdict: Callable[[Any], bool] | None = None,
    extra_pools: list[PoolTransfer] | None = None,
) -> Prefetch:
    """Run a prefetch as SGLang's scheduler does: hit query, host slots for the hit, acks.
    ``stop_after``: terminate it that many seconds after the first progress ack, as the
    ``timeout`` policy would (the IO thread finishes its batch and stops). ``before_read``:
    called with the host slots given to the prefetch, before its IO starts. ``verdict``:
    asked with the operation while no ack is queued; once True the prefetch is terminated as
    SGLang's stop policy does, and the tokens acknowledged by then are those SGLang uses.
    ``extra_pools``: the sidecar pools' transfers; those with slots of their own (a trailing
    window: SWA, Mamba state) get them once the hit is known, as the radix cache stages them."""
    operation = cc.prefetch(
        CacheRequestHandle(rid=rid, attempt_id=0), tokens, extra_pools=extra_pools
    )
    assert cc.prefetch_hit_queue.get(timeout=ACK_TIMEOUT) is operation
    hit = int(operation.storage_hit_count)
    if hit == 0:
        return Prefetch(0, 0, None, 0.0)
    host_indices = cc.alloc_prefetch_host_buffers(operation, hit)
    operation.host_indices = host_indices
    operation.hash_value = operation.hash_value[: len(host_indices) // PAGE]
    for transfer in extra_pools or []:
        if transfer.indices_from_pool is None:
            pool = cc.mem_pool_host.get_pool(transfer.name)
            transfer.host_indices = pool.alloc(len(transfer.keys or ()) * pool.page_size)
    if before_read is not None:
        before_read(host_indices)
    start = time.monotonic()
    cc.prefetch_buffer.put(operation)
    completed = read = 0
    stopped = judged = False
    pool_hits = None
    while True:
        ack = _next_ack(cc, operation, None if judged else verdict)
        if ack is None:
            completed, _ = cc.terminate_prefetch(operation)
            stopped = judged = True
            continue
        if ack.pool_hits is not None:
            pool_hits = dict(ack.pool_hits)
        if ack.completed_tokens is not None:
            read = int(ack.completed_tokens)
        if ack.completed_tokens is not None and not stopped:
            completed = operation.completed_tokens = int(ack.completed_tokens)
            if stop_after is not None:
                time.sleep(stop_after)
                completed, _ = cc.terminate_prefetch(operation)
                stopped = True
        if ack.completed_req:
            seconds = time.monotonic() - start
            return Prefetch(hit, completed, host_indices, seconds, judged, read, pool_hits)


def _next_ack(
    cc: HybridCacheController, operation: Any, verdict: Callable[[Any], bool] | None
) -> Any:
    """The next prefetch ack, or None once ``verdict`` is True while none is queued."""
    if verdict is None:
        return cc.ack_prefetch_queue.get(timeout=ACK_TIMEOUT)
    end = time.monotonic() + ACK_TIMEOUT
    while time.monotonic() < end:
        try:
            return cc.ack_prefetch_queue.get(timeout=_VERDICT_POLL)
        except queue.Empty:
            if verdict(operation):
                return None
    raise TimeoutError("no prefetch ack and no verdict")


def release(cc: HybridCacheController, result: Prefetch) -> None:
    """Give a prefetch's host slots back (after its final ack, as the scheduler does)."""
    if result.host_indices is not None:
        cc.mem_pool_host.free(result.host_indices)


def server_args(model_dir: Path, *flags: str) -> ServerArgs:
    """SGLang's own parsing of a launch command line (a tiny local model: no download)."""
    model = write_tiny_llama(model_dir, weights=False)
    base = ("--model-path", str(model), "--device", "cpu", "--enable-hierarchical-cache")
    return prepare_server_args([*base, *flags])


def scheduler_context(args: ServerArgs) -> AbstractContextManager[Any]:
    """Code inside runs as in one of SGLang's scheduler processes for ``args`` (its parallel
    configuration published), without changing this process's own context."""
    return use_context(create_context(args, role="scheduler"))


class _Captured(Exception):
    """Stops SGLang's cache set-up once it has built the storage extra-config."""


def storage_extra_config(args: ServerArgs) -> dict[str, Any]:
    """The extra-config SGLang's radix cache hands to the storage backend for ``args``:
    ``UnifiedRadixCache.init_hicache`` runs for real, in a runtime context published from
    ``args``, up to the call that builds the host pools and the controller."""
    captured: dict[str, Any] = {}

    def capture(*args: Any, storage_extra_config: dict[str, Any], **kwargs: Any) -> None:
        captured.update(storage_extra_config or {})
        raise _Captured

    cache = UnifiedRadixCache.__new__(UnifiedRadixCache)  # only init_hicache's own state
    cache.sidecar_pool_specs = []
    with pytest.MonkeyPatch.context() as patch, scheduler_context(args):
        patch.setattr(hybrid_pool_assembler, "attach_hybrid_pool_to_unified_cache", capture)
        with pytest.raises(_Captured):
            cache.init_hicache(args, None)
    return captured


class HeldCopies:
    """Holds the transport threads' copies that touch chosen host memory until ``let_go``
    (past the deadline and the settle grace: the request stays unsettled), then performs them
    — the late write (read) or read (write) SGLang must be protected from. The hold is inside a
    copy chunk, after the copier checked the request was still pending: a thread stuck in its
    memcpy, which no deadline can interrupt. Same-host store servers: the backend moves pages
    with shared-memory copies."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.blocked = threading.Event()
        self.let_go = threading.Event()
        original = Copier._copy_chunk

        def copy_chunk(copier: Copier, op: TransferOp, chunk: Sequence[Any]) -> None:
            held = [piece for piece in chunk if self._touches(piece.slice)]
            rest = [piece for piece in chunk if not self._touches(piece.slice)]
            if rest:
                original(copier, op, rest)
            if held:
                self.blocked.set()
                self.let_go.wait()
                original(copier, op, held)

        monkeypatch.setattr(Copier, "_copy_chunk", copy_chunk)
        # Held copies are a transport thread's: none runs inline in the caller.
        monkeypatch.setattr(CopyWorkers, "inline", lambda _workers, _group: False)

    def hold_pages(self, pool: Any, slots: torch.Tensor) -> None:
        """Hold every copy into or out of the pages at ``slots``."""
        pointers, sizes = pool.get_page_buffer_meta(slots)
        self.ranges = [(p, p + n) for p, n in zip(pointers, sizes, strict=True)]

    def _touches(self, piece: Slice) -> bool:
        start = piece.local.address + piece.local_offset
        return any(low <= start < high for low, high in self.ranges)
