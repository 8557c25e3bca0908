"""SGLang plugin: makes ``--hicache-storage-backend kvconnect`` work.

SGLang runs the functions of the ``sglang.srt.plugins`` entry-point group (kvconnect's is
:func:`register`) before it parses arguments, and again in every scheduler process. SGLang
decides several things by backend name; the plugin hooks each (through SGLang's own
``HookRegistry``):

1. the storage factory builds only names it knows: kvconnect's is added;
2. the command line accepts only listed names: ``kvconnect`` is added to the choices;
3. the cache controller picks the zero-copy page functions by name: kvconnect gets them;
4. argument resolution moves only mooncake's (and npu_memcache's) host pool off ``layer_first``
   to a page layout: kvconnect's pool is moved the same way (also on the ``dynamic`` route);
5. on an MLA model's non-writer ranks, the controller backs up rank-sharded draft pools only
   for mooncake: kvconnect's rank-sharded sidecars are backed up too.

Two more hooks let kvconnect's reads answer before SGLang's prefetch verdict (docs/sglang.md,
"Deadlines"), for the literal name and the ``dynamic`` route alike:

6. the controller's page-get function runs inside the backend's ``reading_for(operation)``, so
   the backend learns which prefetch each read serves (its start, its termination);
7. after the radix cache publishes its storage settings (at start and at every attach), the
   backend follows its live prefetch policy, budget and timers, those SGLang's verdict uses.

These targets are SGLang internals, so the plugin only patches the version it was built for
and refuses others with a clear message (the ``dynamic`` route, docs/sglang.md, needs no
patch).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import logging
import time
from typing import Any

from kvconnect.sglang.deadline import PrefetchBudget, PrefetchPolicy

SGLANG_VERSION = "0.5.23"
"""The SGLang release whose internals the plugin patches."""
NAME = "kvconnect"
BACKEND = ("kvconnect.sglang.backend", "KVConnectStore")
DYNAMIC_ROUTE = {
    "backend_name": NAME,
    "module_path": "kvconnect.sglang",
    "class_name": BACKEND[1],
    "interface_v1": 1,
}
"""The extra-config keys that select kvconnect through SGLang's ``dynamic`` loader, with the
zero-copy interface (no plugin needed)."""

_FACTORY = "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory"
_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
_ATTACH = "sglang.srt.managers.cache_controller.HiCacheController.attach_storage_backend"
_LAYOUT = "sglang.srt.arg_groups.hicache_hook.resolve_storage_layout_compatibility"
PAGE_LAYOUTS = {"kernel": "page_first", "direct": "page_first_direct"}
"""The page layout kvconnect's host pool gets instead of ``layer_first``, by io backend (as
SGLang chooses for mooncake; ``page_first`` needs the kernel io backend)."""

log = logging.getLogger(__name__)
_BACKUP = (
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController.should_backup"
)
_PUBLISH = (
    "sglang.srt.mem_cache.unified_cache.storage_attachment.StorageAttachment.apply_runtime_config"
)


def register() -> None:
    """Entry point: register the backend and hook SGLang (raises RuntimeError, which SGLang
    logs, on another SGLang version)."""
    installed = importlib.metadata.version("sglang")
    if installed != SGLANG_VERSION:
        raise RuntimeError(
            f"kvconnect's SGLang plugin supports SGLang {SGLANG_VERSION}, found {installed}: "
            "'--hicache-storage-backend kvconnect' is unavailable. Use "
            "'--hicache-storage-backend dynamic' with backend_name/module_path/class_name/"
            "interface_v1 in --hicache-storage-backend-extra-config (docs/sglang.md)."
        )
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    StorageBackendFactory.register_backend(NAME, *BACKEND)
    HookRegistry.register(f"{_FACTORY}._create_builtin_backend", _build, HookType.AROUND)
    HookRegistry.register(_ARGS, _accept_name, HookType.AFTER)
    HookRegistry.register(_ATTACH, _zero_copy, HookType.AFTER)
    HookRegistry.register(_LAYOUT, _page_layout, HookType.AROUND)
    HookRegistry.register(_PUBLISH, _follow_cache, HookType.AFTER)
    HookRegistry.register(_BACKUP, _backup_rank_sharded, HookType.AROUND)


def _build(
    original: Any,
    cls: Any,
    backend_name: str,
    backend_class: Any,
    storage_config: Any,
    mem_pool_host: Any,
) -> Any:
    """The factory's branch for kvconnect: the backend gets the host pool at once."""
    if backend_name == NAME:
        return backend_class(storage_config, mem_pool_host)
    return original(cls, backend_name, backend_class, storage_config, mem_pool_host)


def _accept_name(result: Any, parser: argparse.ArgumentParser) -> None:
    """After SGLang defined its flags: let ``--hicache-storage-backend`` take ``kvconnect``."""
    for action in parser._actions:
        flag = "--hicache-storage-backend" in action.option_strings
        if flag and action.choices is not None and NAME not in action.choices:
            action.choices = [*action.choices, NAME]


def _zero_copy(result: Any, controller: Any, *args: Any, **kwargs: Any) -> None:
    """After the controller attached a backend: kvconnect moves pages without a copy, and its
    zero-copy reads know the operation they serve."""
    backend = controller.storage_backend
    if getattr(controller, "storage_backend_type", None) == NAME and backend:
        controller.page_get_func = controller._page_get_zero_copy
        controller.page_set_func = controller._page_set_zero_copy
    if _is_kvconnect(backend) and controller.page_get_func == controller._page_get_zero_copy:
        controller.page_get_func = _serving(backend, controller.page_get_func)


def _serving(backend: Any, page_get: Any) -> Any:
    """``page_get`` (SGLang's own, with its bookkeeping) run inside the backend's
    ``reading_for`` the call's operation; it keeps the name and the signature."""

    @functools.wraps(page_get)
    def page_get_for(
        operation: Any, hash_values: Any, host_indices: Any, extra_info: Any = None
    ) -> Any:
        with backend.reading_for(operation):
            return page_get(operation, hash_values, host_indices, extra_info)

    return page_get_for


def _follow_cache(result: Any, attachment: Any, *args: Any, **kwargs: Any) -> None:
    """After the radix cache published its storage settings: a kvconnect backend follows the
    cache's live prefetch policy, budget and timers (a policy changed at runtime included)."""
    cache = attachment._cache
    backend: Any = getattr(cache.cache_controller, "storage_backend", None)
    if _is_kvconnect(backend):
        backend.follow(RadixCacheClock(cache))


class RadixCacheClock:
    """SGLang's radix cache as a :class:`~kvconnect.sglang.deadline.PrefetchClock`: the
    attributes and per-request timers its ``timeout`` verdict reads (written by the scheduler
    thread; read here, from the prefetch IO thread, one attribute or dict lookup at a time)."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache

    def budget(self) -> PrefetchBudget:
        """The prefetch policy and budget the cache applies now."""
        cache = self._cache
        return PrefetchBudget(
            PrefetchPolicy(cache.prefetch_stop_policy),
            float(cache.prefetch_timeout_base),
            float(cache.prefetch_timeout_per_page),
        )

    def verdict(self, operation: Any) -> float | None:
        """When the verdict on ``operation``'s request falls (``time.monotonic``), once its
        wait has started (a refetch finds the request's first one); now if it has fallen."""
        wait = self._cache._storage_prefetch_wait.get(operation.handle)
        if wait is None:
            return None
        if wait.expired:
            return time.monotonic()
        started = wait.timer.started_at  # time.perf_counter
        if started is None:
            return None
        return float(started) + float(wait.timeout_s) + (time.monotonic() - time.perf_counter())


def _backup_rank_sharded(original: Any, controller: Any, transfer: Any) -> bool:
    """SGLang's choice of the sidecars a non-writer rank backs up, plus kvconnect's
    rank-sharded ones (SGLang names only mooncake for MHA draft pools)."""
    if original(controller, transfer):
        return True
    backend = controller.storage_backend
    return _is_kvconnect(backend) and bool(backend.writes_on_every_rank(transfer.name))


def _is_kvconnect(backend: Any) -> bool:
    # Lazy: the backend imports torch and SGLang's storage types, loaded by now.
    from kvconnect.sglang.backend import KVConnectStore

    return isinstance(backend, KVConnectStore)


def _page_layout(original: Any, server_args: Any) -> None:
    """SGLang's storage/layout step, also for kvconnect: a ``layer_first`` host pool (which
    kvconnect refuses) becomes the page layout of the io backend, as for mooncake. Runs in
    SGLang's argument resolution (``handle_hicache``) in place of that step."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    layout = PAGE_LAYOUTS.get(cfg.hicache_io_backend)
    if cfg.hicache_mem_layout != "layer_first" or layout is None or not _selects_kvconnect(cfg):
        original(server_args)
        return
    declare_resolution(server_args, "kvconnect", hicache_mem_layout=layout)
    log.warning(
        "kvconnect stores pages, not layers: --hicache-mem-layout layer_first becomes %s "
        "(io backend %s)",
        layout,
        cfg.hicache_io_backend,
    )


def _selects_kvconnect(cfg: Any) -> bool:
    """Whether the resolving arguments select kvconnect's backend, by name or ``dynamic``."""
    if cfg.hicache_storage_backend == NAME:
        return True
    if cfg.hicache_storage_backend != "dynamic":
        return False
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    try:  # SGLang's own reading of the flag; a bad one is SGLang's to report, later
        extra = HybridCacheController.parse_storage_backend_extra_config(
            cfg.hicache_storage_backend_extra_config
        )[0]
    except Exception:
        return False
    module = str(extra.get("module_path", ""))
    return extra.get("class_name") == BACKEND[1] and module in {"kvconnect.sglang", BACKEND[0]}
