"""SGLang's real ``UnifiedRadixCache`` with HiCache and a kvconnect L3, driven on a CPU.

What SGLang's scheduler does with its radix cache, done by hand: requests' KV is inserted into
the tree (write-through, selective or write-back then copy it to the host pool and on to L3);
a request's prefix is prefetched from L3 (``prefetch_from_storage``) and admission polls
``check_prefetch_progress`` between ``check_hicache_events`` rounds until the prefetch ends;
the pages that landed are then in the tree as a host hit (``match_prefix``). Everything below
the tree is SGLang's own code — the assembler's host pool, ``HybridCacheController`` and its
threads, the prefetch policies — except two CUDA pieces with CPU stand-ins: pinning host memory
(skipped) and the device-to-host copy kernel of the ``page_first_direct`` layout (a torch copy).
Host-to-device load-back needs kernels: the tests stop at the host hit.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    CacheRequestHandle,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.pool_host import common, mha
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_parallel, get_serving
from sglang.srt.server_args import ServerArgs

from kvconnect.sglang.plugin import DYNAMIC_ROUTE
from tests.sglang import harness as h
from tests.support.waiting import wait_for

DEVICE_TOKENS = 64 * h.PAGE  # the host pool gets twice that (SGLang's default ratio)
SETTLE_TIMEOUT = 30.0


def args(
    model_dir: Path,
    extra_config: dict[str, Any],
    *,
    prefetch_policy: str = "timeout",
    write_policy: str = "write_through",
) -> ServerArgs:
    """SGLang's parsing of a command line with HiCache on kvconnect (``dynamic`` route) and
    ``extra_config`` (kvconnect's keys and SGLang's prefetch keys)."""
    return h.server_args(
        model_dir,
        *("--page-size", str(h.PAGE), "--hicache-io-backend", "direct"),
        *("--hicache-mem-layout", "page_first_direct"),
        *("--hicache-storage-backend", "dynamic"),
        *("--hicache-storage-backend-extra-config", json.dumps({**DYNAMIC_ROUTE, **extra_config})),
        *("--hicache-storage-prefetch-policy", prefetch_policy),
        *("--hicache-write-policy", write_policy),
    )


def _copy_device_to_host_pages(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """CPU stand-in for sgl_kernel's ``transfer_kv_all_layer_direct_lf_pf``: device KV
    (per-layer K tensors, then V) to host pages laid out ``(page, layer, token, head, dim)``."""
    layers = len(src_ptrs) // len(dst_ptrs)
    pages = dst_indices[::page_size] // page_size
    for kv, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[kv * layers + layer]
            dst[pages, layer] = src[src_indices].view(-1, page_size, *src.shape[1:])


@contextmanager
def scheduler(server_args: ServerArgs) -> Iterator[None]:
    """Code inside runs as in one SGLang scheduler process (rank 0 of 1) for ``server_args``,
    with the CPU stand-ins of the module docstring."""
    with (
        h.scheduler_context(server_args),
        get_parallel().override(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
        ),
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr(common, "_cuda_host_register", lambda *args, **kwargs: None)
        patch.setattr(
            mha, "transfer_kv_all_layer_direct_lf_pf", _copy_device_to_host_pages, raising=False
        )
        yield


class Engine:
    """One SGLang instance's radix cache with HiCache on kvconnect; build inside
    :func:`scheduler`, :meth:`close` (or ``with``) to shut it down as SGLang does at exit."""

    def __init__(self, server_args: ServerArgs) -> None:
        self.device = MHATokenToKVPool(
            size=DEVICE_TOKENS,
            page_size=h.PAGE,
            dtype=h.DTYPE,
            head_num=h.HEADS,
            head_dim=h.HEAD_DIM,
            layer_num=h.LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        self.allocator = TokenToKVPoolAllocator(
            size=DEVICE_TOKENS, dtype=h.DTYPE, device="cpu", kvcache=self.device, need_sort=False
        )
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=ReqToTokenPool(
                size=8, max_context_len=4096, device="cpu", enable_memory_saver=False
            ),
            token_to_kv_pool_allocator=self.allocator,
            page_size=h.PAGE,
            tree_components=(ComponentType.FULL,),
        )
        self.cache = UnifiedRadixCache(params=params)
        self.cache.init_hicache(server_args, params)
        self._operations: dict[CacheRequestHandle, Any] = {}

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Detach the backend (SGLang's atexit hook) and free the host pool."""
        self.cache.shutdown()
        self.cache.release_host_resources()

    @property
    def controller(self) -> Any:
        return self.cache.cache_controller

    @property
    def host_pool(self) -> Any:
        """The host KV pool (the anchor of SGLang's host pool group; kvconnect's pool)."""
        return self.controller.mem_pool_host.anchor_entry.host_pool

    @property
    def backend(self) -> Any:
        """The kvconnect backend SGLang built (None once detached)."""
        return self.controller.storage_backend

    def detach(self) -> None:
        """``DELETE /hicache/storage-backend``: what the scheduler's handler calls."""
        ok, message = self.cache.detach_storage_backend()
        assert ok, message

    def attach(self, extra_config: dict[str, Any]) -> None:
        """``PUT /hicache/storage-backend`` with kvconnect (``dynamic`` route): what the
        scheduler's handler calls."""
        ok, message = self.cache.attach_storage_backend(
            storage_backend="dynamic",
            storage_backend_extra_config_json=json.dumps({**DYNAMIC_ROUTE, **extra_config}),
            served_model_name=get_serving().served_model_name,
        )
        assert ok, message

    # --------------------------------------------------------------------------- writing

    def insert(self, tokens: list[int], seed: int) -> list[bytes]:
        """A request's KV (seeded random bytes in fresh device slots) inserted into the tree,
        as at the end of its prefill; the bytes of each of its pages as SGLang's host layout
        holds them. Tokens already in the tree keep their KV (and return its bytes)."""
        indices = self.allocator.alloc(len(tokens))
        assert indices is not None, "device pool full"
        generator = torch.Generator().manual_seed(seed)
        for layer in range(h.LAYERS):
            for buffer in (self.device.get_key_buffer(layer), self.device.get_value_buffer(layer)):
                shape = (len(tokens), *buffer.shape[1:])
                buffer[indices] = torch.randn(shape, generator=generator).to(h.DTYPE)
        result = self.cache.insert(InsertParams(key=_key(tokens), value=indices))
        self.allocator.free(indices[: result.prefix_len])  # the tree kept its own copy
        return self.device_pages(tokens)

    def device_pages(self, tokens: list[int]) -> list[bytes]:
        """The bytes of each page of ``tokens`` on the device, in the host layout's order."""
        match = self.cache.match_prefix(MatchPrefixParams(key=_key(tokens)))
        indices = self.cache.path_device_indices(match.last_device_node)
        pages = []
        for start in range(0, len(indices), h.PAGE):
            page = indices[start : start + h.PAGE]
            kv = [
                torch.stack([get(layer)[page] for layer in range(h.LAYERS)])
                for get in (self.device.get_key_buffer, self.device.get_value_buffer)
            ]
            pages.append(torch.stack(kv).view(torch.uint8).numpy().tobytes())
        return pages

    def evict_device(self) -> None:
        """Evict everything evictable from the device (a write-back backs it up first)."""
        self.cache.evict(EvictParams(num_tokens=DEVICE_TOKENS))

    def settle_backups(self) -> None:
        """Run scheduler rounds until no device-to-host or L3 backup is in flight."""
        self.pump(
            lambda: not self.cache.ongoing_write_through and not self.cache.ongoing_backup,
            "backups did not settle",
        )

    # --------------------------------------------------------------------------- reading

    def prefetch(self, rid: str, tokens: list[int]) -> CacheRequestHandle:
        """Submit a prefetch from L3 for a request whose prefix nothing local holds (the
        scheduler's ``_prefetch_kvcache`` for a root match)."""
        handle = CacheRequestHandle(rid=rid, attempt_id=0)
        self.cache.prefetch_from_storage(handle, self.cache.root_node_handle(), array("q", tokens))
        operation = self.operation(handle)
        if operation is not None:
            self._operations[handle] = operation
        return handle

    def poll(self, handle: CacheRequestHandle) -> bool:
        """One scheduler round for a waiting request: events, then admission's progress check;
        True once the prefetch is done with (the request may be scheduled)."""
        self.cache.check_hicache_events()
        return bool(self.cache.check_prefetch_progress(handle))

    def run_prefetch(self, rid: str, tokens: list[int]) -> CacheRequestHandle:
        """Prefetch and poll until admitted."""
        handle = self.prefetch(rid, tokens)
        self.pump(lambda: self.poll(handle), f"prefetch {rid} was never admitted")
        return handle

    def operation(self, handle: CacheRequestHandle) -> Any:
        """The controller's operation of an ongoing prefetch (None once it is done with)."""
        info = self.cache.ongoing_prefetch.get(handle)
        return None if info is None else info.operation

    def lookup(self, tokens: list[int]) -> int:
        """Tokens of ``tokens`` L3 holds, by SGLang's own probe (``query_storage_hit_length``)."""
        root = self.cache.root_node_handle()
        return int(self.cache.query_storage_hit_length(root, array("q", tokens)))

    def host_hit(self, tokens: list[int]) -> int:
        """Tokens of ``tokens`` the tree holds on the host only (``host_hit_length``)."""
        return int(self.cache.match_prefix(MatchPrefixParams(key=_key(tokens))).host_hit_length)

    def slots(self, handle: CacheRequestHandle) -> torch.Tensor:
        """The host slots SGLang gave the prefetch ``handle`` (for the whole hit)."""
        slots = self._operations[handle].host_indices
        assert slots is not None, "no host slots: the prefetch had no hit"
        return slots

    def landed(self, handle: CacheRequestHandle, tokens: list[int]) -> list[bytes]:
        """The bytes of the pages the prefetch put into the tree as the host hit of
        ``tokens`` (on an empty tree the hit is the prefetch's leading slots)."""
        hit = self.host_hit(tokens)
        return h.pages_of(self.host_pool, self.slots(handle)[:hit]) if hit else []

    # ------------------------------------------------------------------------- scheduling

    def pump(self, condition: Callable[[], bool], message: str) -> None:
        """Scheduler rounds (``check_hicache_events``) until ``condition`` holds."""

        def round_then(condition: Callable[[], bool] = condition) -> bool:
            self.cache.check_hicache_events()
            return condition()

        wait_for(round_then, message, SETTLE_TIMEOUT)


def _key(tokens: list[int]) -> RadixKey:
    return RadixKey(array("q", tokens))


def sentinel(host_pool: Any, slots: torch.Tensor) -> bytes:
    """Fill the host pages at ``slots`` with a fixed byte; their expected bytes."""
    for start in range(0, len(slots), h.PAGE):
        host_pool.get_data_page(int(slots[start]), flat=False).view(torch.uint8).fill_(0xA5)
    return bytes([0xA5]) * (len(slots) // h.PAGE * h.PAGE_BYTES)


def page_bytes(host_pool: Any, slots: torch.Tensor) -> bytes:
    """The bytes of the host pages at ``slots``, concatenated."""
    return b"".join(h.pages_of(host_pool, slots))
