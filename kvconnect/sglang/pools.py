"""Hybrid models' sidecar host pools: SGLang's v2 storage interface, on the kvconnect store.

Besides the KV pool, SGLang's hybrid assembler builds host pools for the state a page's
restore also needs: the sliding-window KV (``swa``, gpt-oss and Gemma 3), the Mamba state
(``mamba``, Qwen3-Next), the DSA indexer keys (``indexer``, DeepSeek-V3.2) and, with
speculative decoding, the draft model's pools (``draft``, ``draft_swa``, ``draft_indexer``).
The controller hands each to ``register_mem_host_pool_v2`` and moves their pages with
``PoolTransfer``\\ s alongside the KV pages (``batch_exists_v2``, ``batch_get_v2``,
``batch_set_v2``). Here each pool's buffers are registered once with the transfer engine, its
pages move zero-copy between their place in the pool (the pool's own ``get_page_buffer_meta``)
and store-server memory, and its objects have keys of their own (:func:`sidecar_keys`).

Hit policies, as SGLang defines them: an ``ALL_PAGES`` pool (indexer, draft) must hold every
page of a restorable prefix; a ``TRAILING_PAGES`` pool (SWA and Mamba state) only the window
of its last pages (as many as the transfer has keys), so a prefix can be restorable at one
node boundary and not at the next. ``BLOCK_GROUPS`` and the DeepSeek-V4 pools that use it are
refused at registration.

Threads: :meth:`SidecarPools.register` runs on SGLang's scheduler thread (attach); the others
on its prefetch and backup threads. Store trouble comes back as misses in the results; the
caller (the backend) turns unexpected exceptions into misses too.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from kvconnect.errors import ConfigError
from kvconnect.sglang.keys import PageFormat, PageKeys, SidecarFormat, sidecar_keys
from kvconnect.sglang.withheld import WithheldSlots, withhold_unsettled
from kvconnect.store.client import BatchResult, StoreClient
from kvconnect.store.messages import Code
from kvconnect.transfer.memory import MemoryRegion

log = logging.getLogger(__name__)

PAGE_LAYOUTS = ("page_first", "page_first_direct")

_INDEX_SOURCES: dict[PoolName, tuple[PoolName, ...]] = {
    PoolName.SWA: (PoolName.SWA,),
    PoolName.MAMBA: (PoolName.MAMBA,),
    PoolName.INDEXER: (PoolName.KV,),
    PoolName.DRAFT: (PoolName.KV,),
    PoolName.DRAFT_INDEXER: (PoolName.KV,),
    # follows the KV or the SWA slots, depending on the draft model: both are withheld
    PoolName.DRAFT_SWA: (PoolName.KV, PoolName.SWA),
}
"""The sidecar pools kvconnect stores → the pools whose host slots their transfers use (the
pools whose ``free`` hands those slots to other requests)."""


class PoolMemory:
    """Host buffers registered once with the store client's engine; page pointers → the
    region and offset of each range."""

    def __init__(self, client: StoreClient, buffers: Sequence[torch.Tensor]) -> None:
        spans: list[tuple[int, int, MemoryRegion]] = []
        for buffer in buffers:
            if not isinstance(buffer, torch.Tensor) or not buffer.is_contiguous():
                raise ConfigError("a host pool buffer is not a contiguous tensor to register")
            region = client.register(buffer)
            spans.append((region.address, region.address + region.length, region))
        spans.sort(key=lambda span: span[0])
        self._starts = [start for start, _, _ in spans]
        self._spans = spans

    def locate(
        self, pointers: Sequence[int], sizes: Sequence[int]
    ) -> tuple[list[MemoryRegion], list[int]]:
        """The registered region and the offset in it of each ``[pointer, pointer + size)``;
        raises ConfigError for a range outside every registered buffer."""
        regions, offsets = [], []
        for pointer, size in zip(pointers, sizes, strict=True):
            at = bisect.bisect_right(self._starts, pointer) - 1
            if at < 0 or pointer + size > self._spans[at][1]:
                raise ConfigError(f"page memory at {pointer:#x} is outside the registered pool")
            start, _, region = self._spans[at]
            regions.append(region)
            offsets.append(pointer - start)
        return regions, offsets


@dataclass(frozen=True, slots=True)
class _Pool:
    """One registered sidecar pool."""

    name: PoolName
    host_pool: Any
    keys: PageKeys
    memory: PoolMemory
    shared: bool  # the same bytes on every TP rank: written by the storage writer alone


@dataclass
class SidecarStats:
    """Sidecar pages moved (``SidecarPools.stats``); counters only grow. A page is one
    pool's share of one KV page (e.g. its Mamba state, or its SWA K and V)."""

    pages_read: int = 0
    pages_missed: int = 0
    pages_written: int = 0
    pages_write_failed: int = 0
    pages_withheld: int = 0


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one ``batch_get_v2``/``batch_set_v2`` did: per pool, per page, whether it moved
    (the value SGLang gets), whether the store was unreachable, and pages withheld."""

    results: dict[PoolName, list[bool]]
    unavailable: bool = False
    withheld: int = 0


@dataclass(frozen=True, slots=True)
class _Part:
    """One transfer of a batch: its pool and slots (None: nothing moves, every page reports
    ``skipped``; True for a shared pool another rank writes) and its first key in the batch."""

    transfer: PoolTransfer
    first: int
    pool: _Pool | None = None
    indices: torch.Tensor | None = None
    skipped: bool = False


@dataclass
class _Batch:
    """The object ranges of several transfers, for one store call."""

    keys: list[str] = field(default_factory=list)
    regions: list[MemoryRegion] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    parts: list[_Part] = field(default_factory=list)


class SidecarPools:
    """The sidecar pools of one backend (one TP rank), see the module docstring.

    ``kv_withheld`` is the backend's slot-withholding wrapper of the KV pool (the pools with
    slots of their own get one here); ``writer`` is whether this rank writes shared
    (MLA-shaped) objects (SGLang's ``is_storage_writer``).
    """

    def __init__(
        self,
        client: StoreClient,
        fmt: PageFormat,
        *,
        writer: bool,
        kv_withheld: WithheldSlots,
        write_timeout: float,
    ) -> None:
        self._client = client
        self._format = fmt
        self._writer = writer
        self._write_timeout = write_timeout
        self._pools: dict[PoolName, _Pool] = {}
        self._withheld: dict[PoolName, WithheldSlots] = {PoolName.KV: kv_withheld}
        self._lock = threading.Lock()  # guards stats
        self.stats = SidecarStats()

    # ---------------------------------------------------------------------------- attach

    def register(self, host_pool: Any, name: PoolName) -> None:
        """Register a sidecar pool's buffers once (SGLang's attach, scheduler thread); a pool
        registered again is kept. Raises ConfigError for a pool kvconnect does not store."""
        name = PoolName(name)
        if name in self._pools:
            return
        if name not in _INDEX_SOURCES:
            raise ConfigError(
                f"kvconnect does not store SGLang's {name} host pool (DeepSeek-V4's "
                "compressed pools are not supported yet); run this model without "
                "--hicache-storage-backend or with another backend"
            )
        layout = getattr(host_pool, "layout", "")
        if layout not in PAGE_LAYOUTS:
            raise ConfigError(
                f"kvconnect stores {name} pages of the {' or '.join(PAGE_LAYOUTS)} layouts, "
                f"not {layout!r}: start SGLang with --hicache-mem-layout page_first"
            )
        fmt = _format_of(host_pool, name, self._format.mla)
        pool = _Pool(
            name,
            host_pool,
            sidecar_keys(self._format, fmt),
            PoolMemory(self._client, _buffers_of(host_pool)),
            fmt.shared,
        )
        self._pools[name] = pool
        if _INDEX_SOURCES[name] == (name,):  # the pool hands out slots of its own
            self._withheld[name] = WithheldSlots(host_pool)
        log.info(
            "kvconnect HiCache backend: %s pool %s, keys *%s",
            name,
            type(host_pool).__name__,
            pool.keys.suffixes[0],
        )

    def rank_sharded(self, name: PoolName) -> bool:
        """Whether ``name`` is a registered pool whose bytes differ by TP rank (every rank
        writes its own objects)."""
        pool = self._pools.get(PoolName(name))
        return pool is not None and not pool.shared

    def close(self) -> None:
        """Give the pools their own ``free`` back (slots still withheld stay out). Idempotent."""
        for name, withheld in list(self._withheld.items()):
            if name is not PoolName.KV:
                withheld.uninstall()
                del self._withheld[name]

    # ---------------------------------------------------------------------------- queries

    def exists(
        self, keys: list[str], kv_pages: int, transfers: Sequence[PoolTransfer]
    ) -> PoolTransferResult:
        """SGLang's hit query for a span whose first ``kv_pages`` KV pages are stored: every
        prefix length the sidecar pools can restore too, each pool's own boundary. Raises
        StoreError subclasses (the caller reports no hit)."""
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        if not kv_pages:
            return PoolTransferResult(0, hits, [])
        span = keys[:kv_pages]
        asked = [(t, self._pools.get(PoolName(t.name))) for t in transfers]
        object_keys = [k for _, pool in asked if pool is not None for k in pool.keys.keys(span)]
        found = self._client.batch_exists(object_keys) if object_keys else []
        restorable = set(range(1, kv_pages + 1))
        at = 0
        for transfer, pool in asked:
            if pool is None:  # not registered: nothing of it is stored
                stored = [False] * kv_pages
            else:
                per_page = pool.keys.objects
                flags = found[at : at + kv_pages * per_page]
                at += kv_pages * per_page
                stored = [all(flags[p * per_page : (p + 1) * per_page]) for p in range(kv_pages)]
            allowed = _restorable_prefixes(transfer, stored)
            if allowed:
                hits[transfer.name] = max(allowed)
            restorable &= allowed
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def get(self, transfers: Sequence[PoolTransfer], timeout: float) -> Outcome:
        """Read each transfer's pages into its pool within ``timeout`` seconds; per page,
        whether it arrived whole (SGLang uses each pool's leading run)."""
        batch = self._batch(transfers, write=False)
        if not batch.keys:
            return self._outcome(batch, [], None, write=False)
        result = self._client.batch_get_into(
            batch.keys, batch.regions, batch.offsets, batch.sizes, timeout=timeout
        )
        done = [
            code is Code.OK and got == size
            for code, got, size in zip(result.codes, result.sizes, batch.sizes, strict=True)
        ]
        return self._outcome(batch, done, result, write=False)

    def set(self, transfers: Sequence[PoolTransfer]) -> Outcome:
        """Write each transfer's pages from its pool (pages already stored count as written,
        shared pools count as written on ranks that are not the storage writer)."""
        batch = self._batch(transfers, write=True)
        if not batch.keys:
            return self._outcome(batch, [], None, write=True)
        result = self._client.batch_put_from(
            batch.keys, batch.regions, batch.offsets, batch.sizes, timeout=self._write_timeout
        )
        return self._outcome(batch, result.ok(), result, write=True)

    # ---------------------------------------------------------------------------- helpers

    def _batch(self, transfers: Sequence[PoolTransfer], *, write: bool) -> _Batch:
        batch = _Batch()
        for transfer in transfers:
            pages = transfer.keys or []
            pool, indices = self._slots(transfer)
            if pool is None or indices is None or not pages:
                batch.parts.append(_Part(transfer, len(batch.keys)))
                continue
            if write and pool.shared and not self._writer:  # as for MLA KV pages
                batch.parts.append(_Part(transfer, len(batch.keys), skipped=True))
                continue
            pointers, sizes = pool.host_pool.get_page_buffer_meta(indices)
            if len(pointers) != len(pages) * pool.keys.objects:
                raise ConfigError(
                    f"the {pool.name} pool gave {len(pointers)} ranges for {len(pages)} pages; "
                    f"expected {pool.keys.objects} per page"
                )
            regions, offsets = pool.memory.locate(pointers, sizes)
            batch.parts.append(_Part(transfer, len(batch.keys), pool, indices))
            batch.keys += pool.keys.keys(pages)
            batch.regions += regions
            batch.offsets += offsets
            batch.sizes += [int(size) for size in sizes]
        return batch

    def _slots(self, transfer: PoolTransfer) -> tuple[_Pool | None, torch.Tensor | None]:
        """The transfer's registered pool and host slots; None for either when it cannot
        move (an unregistered pool, or slots that do not match its keys: SGLang then expects
        nothing fetched)."""
        pool = self._pools.get(PoolName(transfer.name))
        indices = transfer.host_indices
        if pool is None or indices is None:
            return pool, None
        if len(indices) != len(transfer.keys or []) * int(pool.host_pool.page_size):
            return pool, None
        return pool, indices

    def _outcome(
        self, batch: _Batch, done: list[bool], result: BatchResult | None, *, write: bool
    ) -> Outcome:
        results: dict[PoolName, list[bool]] = {}
        withheld = 0
        for part in batch.parts:
            pages = len(part.transfer.keys or [])
            if part.pool is None or part.indices is None or result is None:
                results[part.transfer.name] = [part.skipped] * pages
                continue
            per_page = part.pool.keys.objects
            span = slice(part.first, part.first + pages * per_page)
            flags = done[span]
            results[part.transfer.name] = [
                all(flags[p * per_page : (p + 1) * per_page]) for p in range(pages)
            ]
            withheld += self._withhold(part.pool, part.indices, result.codes[span], result)
        self._count(results, write, withheld)
        codes = result.codes if result is not None else []
        unavailable = any(code is Code.UNAVAILABLE for code in codes)
        return Outcome(results, unavailable, withheld)

    def _withhold(
        self, pool: _Pool, host_indices: torch.Tensor, codes: Sequence[Code], result: BatchResult
    ) -> int:
        """Keep the slots of pages with an UNSETTLED object from reuse until their transfer
        settles, in every pool whose slots they are; pages withheld."""
        pools = [self._withheld[s] for s in _INDEX_SOURCES[pool.name] if s in self._withheld]
        page_size = int(pool.host_pool.page_size)
        return withhold_unsettled(pools, host_indices, page_size, codes, pool.keys.objects, result)

    def _count(self, results: dict[PoolName, list[bool]], write: bool, withheld: int) -> None:
        moved = sum(sum(flags) for flags in results.values())
        failed = sum(len(flags) for flags in results.values()) - moved
        with self._lock:
            if write:
                self.stats.pages_written += moved
                self.stats.pages_write_failed += failed
            else:
                self.stats.pages_read += moved
                self.stats.pages_missed += failed
            self.stats.pages_withheld += withheld


def _restorable_prefixes(transfer: PoolTransfer, stored: Sequence[bool]) -> set[int]:
    """The prefix lengths (in pages, 1..len(stored)) a pool can restore, by its hit policy,
    given which of the span's pages it holds. ``ALL_PAGES``: the leading run of stored pages;
    ``TRAILING_PAGES``: every length whose window (the transfer's key count, at least 1) of
    last pages is stored. Any other policy restores nothing (the safe side)."""
    policy = PoolHitPolicy(transfer.hit_policy)
    if policy is PoolHitPolicy.ALL_PAGES:
        run = stored.index(False) if False in stored else len(stored)
        return set(range(1, run + 1))
    if policy is PoolHitPolicy.TRAILING_PAGES:
        window = max(1, len(transfer.keys or ()))
        return {end for end in range(1, len(stored) + 1) if all(stored[max(0, end - window) : end])}
    return set()


def _buffers_of(host_pool: Any) -> list[torch.Tensor]:
    """The host tensors holding a pool's pages: its ``kv_buffer`` when it is one tensor (MHA,
    MLA: K and V are views of it), else the buffers it lists (Mamba: temporal and conv
    states; the indexer: its key buffer)."""
    kv_buffer = getattr(host_pool, "kv_buffer", None)
    if isinstance(kv_buffer, torch.Tensor):
        return [kv_buffer]
    return [b for b in host_pool.get_hybrid_pool_buffer() if b is not None and b.numel() > 0]


def _format_of(host_pool: Any, name: PoolName, mla: bool) -> SidecarFormat:
    """The pool's key-relevant format; its objects per page are counted from its own page
    metadata (raises ConfigError when it cannot give any, e.g. Mamba side states)."""
    page = torch.arange(int(host_pool.page_size), dtype=torch.int64)
    try:
        pointers, _ = host_pool.get_page_buffer_meta(page)
    except (NotImplementedError, ValueError, AssertionError) as exc:
        raise ConfigError(
            f"SGLang's {name} host pool has no zero-copy page metadata: {exc}"
        ) from exc
    dtype = str(getattr(host_pool, "dtype", "unknown")).removeprefix("torch.")
    return SidecarFormat(
        name=str(name.value),
        layout=str(host_pool.layout),
        dtype=dtype,
        objects=len(pointers),
        shared=mla and _rank_replicated(host_pool, name),
    )


def _rank_replicated(host_pool: Any, name: PoolName) -> bool:
    """Whether, in an MLA model, every TP rank holds this pool's bytes whole: all pools but
    the Mamba state and MHA-shaped (head-sharded) draft or SWA pools."""
    return name is not PoolName.MAMBA and not isinstance(host_pool, MHATokenToKVPoolHost)
