"""``KVConnectStore``: SGLang HiCache's L3 tier on the kvconnect store.

SGLang calls this from its scheduler thread (attach, ``batch_exists``) and from the cache
controller's backup and prefetch threads (``batch_set_v1``, ``batch_get_v1``), each with at
most 128 pages; for hybrid models also ``batch_exists_v2``, ``batch_get_v2`` and
``batch_set_v2``, which move the sidecar pools' pages (kvconnect/sglang/pools.py). Pages
move without a copy: the whole host KV pool is registered once with the transfer engine, and
every page is read or written straight between its place in the pool and store-server memory.

Contract with SGLang, and why:

* Nothing raises into SGLang's threads (an exception ends its prefetch or backup thread):
  store trouble is logged, counted and returned as a miss or a failed write.
* ``batch_get_v1`` answers before SGLang's prefetch budget runs out (kvconnect/sglang/deadline.py;
  ``read_timeout``, if set, bounds it further) and stops as soon as SGLang terminates the
  prefetch; SGLang uses the leading pages that arrived and recomputes the rest, and frees the
  host slots of the others. A page whose transfer could not
  be stopped (``Code.UNSETTLED``: a transport may still write it) is withheld: SGLang's free of
  its slots is deferred until the transfer settles (kvconnect/sglang/withheld.py), so a late
  write never lands in another request's KV. The same holds for the source pages of a write
  that a transport may still read.
* While the store fails, the client's circuit breaker makes every call fail fast: lookups
  report 0 pages, writes are skipped — SGLang runs on its local tiers alone — and one probe
  per ``breaker_cooldown`` finds the store again.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvconnect.errors import ConfigError, StoreError
from kvconnect.sglang.config import HiCacheConfig, parse_config
from kvconnect.sglang.deadline import (
    DEFAULT_BASE,
    DEFAULT_PER_KI_TOKEN,
    Operation,
    PrefetchBudget,
    PrefetchClock,
    PrefetchPolicy,
    read_deadline,
)
from kvconnect.sglang.keys import PageFormat, PageKeys, page_keys
from kvconnect.sglang.metrics import BackendMetrics, moved_bytes
from kvconnect.sglang.pools import Outcome, PoolMemory, SidecarPools, SidecarStats
from kvconnect.sglang.withheld import WithheldSlots, pages_with, withhold_unsettled
from kvconnect.store.client import BatchResult, Regions, StoreClient
from kvconnect.store.config import StoreServerConfig
from kvconnect.store.messages import Code
from kvconnect.store.resilience import BreakerState
from kvconnect.store.server import StoreServer
from kvconnect.transfer import TransferConfig

log = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("page_first", "page_first_direct", "page_head")
_WARN_EVERY = 10.0  # seconds between WARNING lines about the same kind of store trouble


class _Trouble(enum.StrEnum):
    """What a WARNING is about: each has its own clock (:meth:`KVConnectStore._warn`); the value
    names it in the line."""

    EXISTS = "exists"  # the store failed a lookup
    UNSETTLED = "unsettled"  # transfers still running past their deadline
    BATCH_EXISTS = "batch_exists"  # unexpected errors, by SGLang call
    BATCH_GET = "batch_get_v1"
    BATCH_SET = "batch_set_v1"
    BATCH_EXISTS_V2 = "batch_exists_v2"
    BATCH_GET_V2 = "batch_get_v2"
    BATCH_SET_V2 = "batch_set_v2"


@dataclass
class BackendStats:
    """What the backend did (``KVConnectStore.stats``); counters only grow."""

    pages_read: int = 0
    pages_missed: int = 0  # asked for, not delivered (absent, late or failed)
    pages_written: int = 0  # stored, including pages the store already held
    pages_write_failed: int = 0
    bytes_read: int = 0  # moved by the calls (pages already stored move none)
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    errors: int = 0  # unexpected exceptions turned into misses
    pages_withheld: int = 0  # pages kept from SGLang until their unsettled transfer let go
    pages_canceled: int = 0  # of pages_missed: stopped because SGLang ended their prefetch


class KVConnectStore(HiCacheStorage):  # type: ignore[misc]  # sglang is untyped
    """SGLang ``HiCacheStorage`` with the zero-copy (v1) interface; see the module docstring.

    Built by SGLang's factory as ``KVConnectStore(storage_config, host_pool)`` (the
    ``kvconnect`` backend name, through the plugin) or ``KVConnectStore(storage_config, {})``
    (the ``dynamic`` route); the host pool is then given by ``register_mem_pool_host``.
    Raises ConfigError for bad settings (at SGLang's start, not in its IO threads).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, host_pool: Any = None) -> None:
        super().__init__()
        self.storage_config = storage_config
        self.config: HiCacheConfig = parse_config(storage_config.extra_config)
        self.stats = BackendStats()
        self.metrics = BackendMetrics(storage_config)  # with SGLang's --enable-metrics
        self._lock = threading.Lock()  # guards stats and the warning clock
        self._last_warning: dict[_Trouble, float] = {}
        self._healthy = True
        self._keys: PageKeys | None = None
        self._memory: PoolMemory | None = None
        self._withheld: WithheldSlots | None = None
        self._fallback_budget: PrefetchBudget | None = None
        self._clock: PrefetchClock | None = None
        self._reading = _Reading()
        self._sidecars: SidecarPools | None = None
        self._head_split = 1
        self._server = self._start_local_store()
        self._client = StoreClient(self.config.store, self._with_token(self.config.transfer))
        try:
            self._client.start()
            if host_pool is not None and not isinstance(host_pool, dict):
                self.register_mem_pool_host(host_pool)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------------------- lifecycle

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the page format and register the host KV pool once (SGLang's attach)."""
        if self._memory is not None and getattr(self, "mem_pool_host", None) is mem_pool_host:
            return
        super().register_mem_pool_host(mem_pool_host)
        layout = getattr(mem_pool_host, "layout", "")
        if layout not in SUPPORTED_LAYOUTS:
            # layer_first (a page would be 2 objects per layer) is moved to a page layout at
            # start by the plugin; it arrives here by a runtime attach to a server started
            # without L3.
            raise ConfigError(
                f"kvconnect stores pages of the {', '.join(SUPPORTED_LAYOUTS)} host layouts, "
                f"not {layout!r}: start SGLang with --hicache-mem-layout page_first"
            )
        fmt = _page_format(self.storage_config, mem_pool_host, self.config)
        self._keys = page_keys(fmt)
        buffer = mem_pool_host.kv_buffer
        if not isinstance(buffer, torch.Tensor):
            raise ConfigError("the host KV pool has no kv_buffer tensor to register")
        if fmt.head_split > 1 and mem_pool_host.head_num % fmt.head_split:
            raise ConfigError(
                f"tp_lcm_size cuts this rank's {mem_pool_host.head_num} KV heads into "
                f"{fmt.head_split} shards: it must divide them"
            )
        self._head_split = fmt.head_split
        self._memory = PoolMemory(self._client, [buffer])
        self._uninstall()
        self._withheld = WithheldSlots(mem_pool_host)
        self._sidecars = SidecarPools(
            self._client,
            fmt,
            writer=self.storage_config.is_storage_writer,
            kv_withheld=self._withheld,
            write_timeout=self.config.write_timeout,
        )
        self._fallback_budget = _fallback_budget(self.storage_config, int(mem_pool_host.page_size))
        log.info(
            "kvconnect HiCache backend: %s, keys %s*, store %s",
            type(mem_pool_host).__name__,
            self._keys.prefix,
            self.config.store.master,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register a hybrid model's sidecar pool (sliding window, Mamba state, indexer, draft;
        kvconnect/sglang/pools.py) once; the KV pool is the one ``register_mem_pool_host``
        registered. Raises ConfigError (at attach) for a pool kvconnect does not store."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if PoolName(host_pool_name) is PoolName.KV:
            return
        if self._sidecars is None:
            raise ConfigError("the host KV pool must be registered before its sidecar pools")
        self._sidecars.register(host_pool, PoolName(host_pool_name))

    def clear(self) -> None:
        """Nothing is removed: the store is shared by every engine of the cluster, so one
        engine's ``/clear_hicache_storage_backend`` must not wipe the others' pages."""
        log.info("kvconnect HiCache backend: clear() leaves the shared store untouched")

    def close(self) -> None:
        """Close the store client (and the embedded store server), give the host pool its
        own ``free`` back (slots still withheld stay out of it). Idempotent."""
        self._client.close()
        self._uninstall()
        if self._server is not None:
            self._server.close()
            self._server = None

    @property
    def local_only(self) -> bool:
        """Whether the store is considered down (SGLang then runs on its local tiers)."""
        return self.breaker_state is not BreakerState.CLOSED

    @property
    def sidecar_stats(self) -> SidecarStats | None:
        """What the sidecar pools of a hybrid model moved (None before attach)."""
        return self._sidecars.stats if self._sidecars is not None else None

    @property
    def breaker_state(self) -> BreakerState:
        """``closed`` (store in use), ``open`` (failing fast) or ``half_open`` (probing); a
        ``str`` enum, equal to those strings."""
        return self._client.breaker.state

    # ----------------------------------------------------------------------------- deadline

    def follow(self, clock: PrefetchClock) -> None:
        """Take SGLang's prefetch policy, budget and running clocks from ``clock``, asked at
        every read. The plugin passes its view of the radix cache: the settings and timers
        SGLang's own verdict uses (scheduler thread, at attach). Until then: the
        ``prefetch_timeout_*`` keys if SGLang left them in the extra-config, else SGLang's
        defaults; the policy of SGLang's server arguments, else ``timeout``; no clock (each
        operation's creation starts its budget)."""
        self._clock = clock

    @property
    def prefetch_budget(self) -> PrefetchBudget:
        """SGLang's prefetch policy and budget the reads follow now (see :meth:`follow`);
        only once the host pool is registered."""
        assert self._fallback_budget is not None  # set with the pool, before any read
        if self._clock is None:
            return self._fallback_budget
        try:
            return self._clock.budget()
        except (AttributeError, TypeError, ValueError):  # SGLang's state is not what we know
            return self._fallback_budget

    @contextlib.contextmanager
    def reading_for(self, operation: Any) -> Iterator[None]:
        """The calling thread's reads inside serve SGLang's ``PrefetchOperation``: they end by
        its deadline and stop once SGLang terminates it (``is_terminated``). The plugin runs
        the controller's page-get function in this, on the prefetch IO thread."""
        self._reading.operation = operation
        try:
            yield
        finally:
            self._reading.operation = None

    # ---------------------------------------------------------------------------- zero-copy

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many pages from the first are stored (0 while the store is unhealthy)."""
        try:
            naming = self._require_keys()
            start = time.monotonic()
            found = self._client.batch_exists(naming.keys(keys))
            self.metrics.exists(time.monotonic() - start)
            self._set_healthy(True)
            return naming.leading_pages(found)
        except StoreError as exc:
            self._store_trouble(_Trouble.EXISTS, exc)
            return 0
        except Exception:
            self._unexpected(_Trouble.BATCH_EXISTS)
            return 0

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages into the host pool by the read's deadline (see the module docstring);
        True for each page that arrived whole (SGLang uses the leading run)."""
        try:
            return self._transfer(keys, host_indices, write=False)
        except Exception:
            self._unexpected(_Trouble.BATCH_GET)
            return [False] * len(keys)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write pages from the host pool (pages already stored are skipped and count as
        written); False for pages not stored."""
        try:
            if not self.storage_config.is_storage_writer:
                return [True] * len(keys)  # MLA: another rank writes the shared pages
            return self._transfer(keys, host_indices, write=True)
        except Exception:
            self._unexpected(_Trouble.BATCH_SET)
            return [False] * len(keys)

    # ------------------------------------------------------------------- hybrid models (v2)

    def writes_on_every_rank(self, name: PoolName) -> bool:
        """Whether this rank must back up pool ``name`` even when it is not the storage writer
        (a rank-sharded sidecar of an MLA model, e.g. an MHA draft's KV): the plugin tells
        SGLang's controller, which asks only for its mooncake backend by itself."""
        return self._sidecars is not None and self._sidecars.rank_sharded(name)

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The KV pages stored from the first, narrowed to the prefix lengths every sidecar
        pool can restore by its hit policy (no hit while the store is unhealthy)."""
        try:
            kv_pages = self.batch_exists(keys, extra_info)
            if self._sidecars is None:
                raise ConfigError("the host KV pool is not registered yet")
            return self._sidecars.exists(keys, kv_pages, pool_transfers or [])
        except StoreError as exc:
            self._store_trouble(_Trouble.EXISTS, exc)
        except Exception:
            self._unexpected(_Trouble.BATCH_EXISTS_V2)
        return PoolTransferResult(0, {}, [])

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[PoolName, list[bool]]:
        """Read sidecar pages into their pools within the budget of their pages (capped by
        ``read_timeout``); per pool, True for each page that arrived whole (SGLang uses each
        pool's leading run)."""
        try:
            return self._sidecar_io(transfers, write=False)
        except Exception:
            self._unexpected(_Trouble.BATCH_GET_V2)
            return _misses(transfers)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[PoolName, list[bool]]:
        """Write sidecar pages from their pools; False for pages not stored."""
        try:
            return self._sidecar_io(transfers, write=True)
        except Exception:
            self._unexpected(_Trouble.BATCH_SET_V2)
            return _misses(transfers)

    # ------------------------------------------------------------------- legacy (copy) API

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Not used: kvconnect is selected with the zero-copy interface (``interface_v1``)."""
        return None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[None]:
        """Not used (zero-copy only): every page is a miss."""
        return [None] * len(keys)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Not used (zero-copy only): nothing is stored."""
        return False

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Not used (zero-copy only): nothing is stored."""
        return False

    def exists(self, key: str) -> bool:
        """Whether one page is stored."""
        return self.batch_exists([key]) == 1

    def get_stats(self) -> StorageMetrics | None:
        """Pages and bandwidth (GiB/s) of each read and write since the last call, as SGLang's
        other backends report them (its metrics collector asks with ``--enable-metrics``;
        kvconnect/sglang/metrics.py)."""
        return self.metrics.take_storage_metrics()

    # ------------------------------------------------------------------------------ helpers

    def _sidecar_io(
        self, transfers: list[PoolTransfer], *, write: bool
    ) -> dict[PoolName, list[bool]]:
        sidecars = self._sidecars
        if sidecars is None:
            raise ConfigError("the host KV pool is not registered yet")
        if write:
            outcome: Outcome = sidecars.set(transfers)
        else:
            outcome = sidecars.get(transfers, self._sidecar_timeout(transfers))
        if outcome.withheld:
            self._warn(
                _Trouble.UNSETTLED,
                "kvconnect: %d sidecar page(s) still in transfer past the deadline; their host "
                "slots are withheld from SGLang until the transfer lets go",
                outcome.withheld,
            )
        self._set_healthy(not outcome.unavailable)
        return outcome.results

    def _sidecar_timeout(self, transfers: list[PoolTransfer]) -> float:
        """A sidecar read's bound: the budget of its pages, as a read of KV pages SGLang's
        verdict does not bound (it never cuts a sidecar read once the KV landed)."""
        pages = max((len(transfer.keys or ()) for transfer in transfers), default=0)
        now = time.monotonic()
        end = read_deadline(
            self.prefetch_budget,
            now,
            pages,
            operation=None,
            margin=self.config.deadline_margin,
            cap=self.config.read_timeout,
        )
        return end - now

    def _uninstall(self) -> None:
        """Give the host pools their own ``free`` back (at detach or a new KV pool)."""
        if self._sidecars is not None:
            self._sidecars.close()
            self._sidecars = None
        if self._withheld is not None:
            self._withheld.uninstall()
            self._withheld = None

    def _page_meta(self, host_indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Pointers and sizes of every object of the pages at ``host_indices`` (SGLang's order:
        page by page; split heads, ``page_head``: shard by shard within a page)."""
        pool = self.mem_pool_host
        if self._head_split > 1:
            return pool.get_split_heads_page_buffer_meta(host_indices, self._head_split)  # type: ignore[no-any-return]
        return pool.get_page_buffer_meta(host_indices)  # type: ignore[no-any-return]

    def _transfer(self, keys: list[str], host_indices: torch.Tensor, *, write: bool) -> list[bool]:
        naming = self._require_keys()
        assert self._memory is not None
        pointers, page_sizes = self._page_meta(host_indices)
        sizes = [int(size) for size in page_sizes]
        region, offsets = self._memory.locate(pointers, sizes)
        object_keys = naming.keys(keys)
        if len(offsets) != len(object_keys):
            raise ConfigError(
                f"the host pool gave {len(offsets)} ranges for {len(keys)} pages; "
                f"expected {naming.objects} per page"
            )
        start = time.monotonic()
        if write:
            timeout = self.config.write_timeout
            result = self._client.batch_put_from(
                object_keys, region, offsets, sizes, timeout=timeout
            )
            done = result.ok()
        else:
            result = self._read(object_keys, region, offsets, sizes, len(keys))
            # A smaller object than the page is not this page (it cannot happen with these
            # keys; refuse it rather than hand SGLang a half-filled page).
            done = [
                code is Code.OK and got == size
                for code, got, size in zip(result.codes, result.sizes, sizes, strict=True)
            ]
        pages = [all(done[i : i + naming.objects]) for i in range(0, len(done), naming.objects)]
        self._withhold_unsettled(host_indices, result, naming.objects)
        self._account(write, pages, sizes, time.monotonic() - start, result.codes)
        return pages

    def _read(
        self,
        object_keys: list[str],
        region: Regions,
        offsets: list[int],
        sizes: list[int],
        pages: int,
    ) -> BatchResult:
        """Read by the deadline of the operation being served (or of this call alone), and
        stop once SGLang terminates that operation."""
        operation = self._reading.operation
        served = _operation(operation, int(self.mem_pool_host.page_size), self._verdict)
        now = time.monotonic()
        end = read_deadline(
            self.prefetch_budget,
            now,
            pages,
            operation=served,
            margin=self.config.deadline_margin,
            cap=self.config.read_timeout,
        )
        if end <= now:  # SGLang's verdict is due: asking the store could only lose
            return BatchResult((Code.TIMEOUT,) * len(object_keys), (0,) * len(object_keys))
        cancel = getattr(operation, "is_terminated", None)
        result = self._client.batch_get_into(
            object_keys, region, offsets, sizes, timeout=end - now, cancel=cancel
        )
        canceled = len(pages_with(result.codes, len(object_keys) // pages, Code.CANCELED))
        if canceled:
            with self._lock:
                self.stats.pages_canceled += canceled
        return result

    def _verdict(self, operation: Any) -> float | None:
        if self._clock is None:
            return None
        try:
            return self._clock.verdict(operation)
        except (AttributeError, TypeError, ValueError):  # as in prefetch_budget
            return None

    def _withhold_unsettled(
        self, host_indices: torch.Tensor, result: BatchResult, objects: int
    ) -> None:
        """Keep the host slots of pages with an UNSETTLED object from reuse until their
        transfer settles (before returning to SGLang, which may free them at once)."""
        codes = result.codes
        if Code.UNSETTLED not in codes:
            return
        withheld = self._withheld
        assert withheld is not None  # installed with the pool, before any transfer
        page_size = len(host_indices) // (len(codes) // objects)
        count = withhold_unsettled([withheld], host_indices, page_size, codes, objects, result)
        with self._lock:
            self.stats.pages_withheld += count
        self.metrics.withheld(count)
        self._warn(
            _Trouble.UNSETTLED,
            "kvconnect: %d page(s) still in transfer past the deadline; their host slots are "
            "withheld from SGLang until the transfer lets go",
            count,
        )

    def _account(
        self,
        write: bool,
        pages: list[bool],
        sizes: Sequence[int],
        seconds: float,
        codes: Sequence[Code],
    ) -> None:
        done = sum(pages)
        moved = moved_bytes(codes, sizes)
        with self._lock:
            if write:
                self.stats.pages_written += done
                self.stats.pages_write_failed += len(pages) - done
                self.stats.bytes_written += moved
                self.stats.write_seconds += seconds
            else:
                self.stats.pages_read += done
                self.stats.pages_missed += len(pages) - done
                self.stats.bytes_read += moved
                self.stats.read_seconds += seconds
        (self.metrics.write if write else self.metrics.read)(pages, codes, moved, seconds)
        unavailable = any(code is Code.UNAVAILABLE for code in codes)
        self._set_healthy(not unavailable)

    def _require_keys(self) -> PageKeys:
        if self._keys is None:
            raise ConfigError("the host KV pool is not registered yet")
        return self._keys

    def _with_token(self, config: TransferConfig) -> TransferConfig:
        """``config`` with this backend's cluster token (None: insecure)."""
        token = self.config.cluster_token()
        return config.replace(token=token, insecure=token is None)

    def _start_local_store(self) -> StoreServer | None:
        """This rank's share of the host's ``local_store_size`` as an embedded store server."""
        if not self.config.local_store_size:
            return None
        share = self.config.local_store_size // _ranks_on_host()
        server = StoreServer(
            StoreServerConfig(master=self.config.store.master, size=share),
            # Not the client's section: the server's engine serves every client, so the
            # transport forced for this backend's reads must not switch RDMA off for them.
            self._with_token(TransferConfig.from_env(listen_host=self.config.transfer.listen_host)),
        )
        server.start()
        return server

    def _set_healthy(self, healthy: bool) -> None:
        self.metrics.breaker(self.breaker_state)
        if self.metrics.enabled:  # not worth the peers' snapshot on every call otherwise
            self.metrics.peers(self._client.peers())
        if healthy == self._healthy:
            return
        self._healthy = healthy
        if healthy:
            log.info("kvconnect store reachable again: L3 reads and writes resume")
        else:
            log.warning(
                "kvconnect store unavailable: running local-only (no L3) until it answers; "
                "probing every %.1fs",
                self.config.store.breaker_cooldown,
            )

    def _store_trouble(self, what: _Trouble, exc: Exception) -> None:
        self._set_healthy(False)
        self._warn(what, "kvconnect store %s failed: %s", what, exc)

    def _unexpected(self, what: _Trouble) -> None:
        with self._lock:
            self.stats.errors += 1
        self.metrics.error(what)
        self._warn(what, "kvconnect HiCache %s failed; treated as a miss", what, exc_info=True)

    def _warn(self, kind: _Trouble, message: str, *args: object, exc_info: bool = False) -> None:
        """At most one WARNING per kind every few seconds (an outage is one story)."""
        now = time.monotonic()
        with self._lock:
            quiet = now - self._last_warning.get(kind, -_WARN_EVERY) < _WARN_EVERY
            if not quiet:
                self._last_warning[kind] = now
        log.log(logging.DEBUG if quiet else logging.WARNING, message, *args, exc_info=exc_info)


def _misses(transfers: list[PoolTransfer]) -> dict[PoolName, list[bool]]:
    return {transfer.name: [False] * len(transfer.keys or []) for transfer in transfers}


class _Reading(threading.local):
    """The SGLang prefetch operation the current thread reads for (None: unknown)."""

    operation: Any = None


def _operation(
    operation: Any, page_size: int, verdict: Callable[[Any], float | None]
) -> Operation | None:
    """What a read needs of SGLang's ``PrefetchOperation`` (None without one): its creation
    time, the pages SGLang's budget counts (requested tokens, else the pages it reads) and
    SGLang's verdict if its clock runs."""
    start = getattr(operation, "start_time", None)
    if not isinstance(start, float):
        return None
    requested = int(getattr(operation, "stats_requested_tokens", 0) or 0) // page_size
    pages = requested or len(getattr(operation, "hash_value", None) or ())
    return Operation(start, pages, verdict(operation))


def _fallback_budget(storage: HiCacheStorageConfig, page_size: int) -> PrefetchBudget:
    """SGLang's prefetch budget as far as the backend sees it alone (see
    ``KVConnectStore.follow``); ConfigError for settings SGLang would refuse."""
    extra = storage.extra_config or {}
    try:
        return PrefetchBudget.of(
            _server_prefetch_policy(),
            extra.get("prefetch_timeout_base", DEFAULT_BASE),
            extra.get("prefetch_timeout_per_ki_token", DEFAULT_PER_KI_TOKEN),
            page_size=page_size,
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad SGLang prefetch settings: {exc}") from exc


def _server_prefetch_policy() -> str:
    """``--hicache-storage-prefetch-policy`` of this SGLang process, or SGLang's default
    outside a scheduler (no server arguments published)."""
    try:
        from sglang.srt.runtime_context import get_memory  # an internal, as get_parallel

        return str(get_memory().hicache_storage_prefetch_policy)
    except (ImportError, ValueError, AttributeError):
        return PrefetchPolicy.TIMEOUT


def _ranks_on_host() -> int:
    """SGLang's scheduler processes of this engine on this host: its tp * pp * dp ranks spread
    evenly over its nodes (with DP attention the DP ranks are inside TP and dp_size is 1).
    Raises ConfigError outside an SGLang scheduler (no parallel configuration published)."""
    try:
        # Lazy: SGLang's runtime context is an internal of recent releases (the dynamic route
        # also serves others), needed only with local_store_size.
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        ranks = int(parallel.tp_size * parallel.pp_size * parallel.dp_size)
        return max(ranks // int(parallel.nnodes), 1)
    except (ImportError, ValueError, RuntimeError) as exc:
        raise ConfigError(
            "local_store_size is shared by the SGLang ranks of this host; SGLang has not "
            f"published its parallel configuration in this process ({exc})"
        ) from exc


def _page_format(storage: HiCacheStorageConfig, pool: Any, config: HiCacheConfig) -> PageFormat:
    dtype = str(getattr(pool, "dtype", "unknown")).removeprefix("torch.")
    return PageFormat(
        model=storage.model_name or "unnamed-model",
        layout=pool.layout,
        dtype=dtype,
        page_size=int(pool.page_size),
        mla=bool(storage.is_mla_model),
        tp_rank=storage.tp_rank,
        tp_size=storage.tp_size,
        pp_rank=storage.pp_rank,
        pp_size=storage.pp_size,
        cp_rank=storage.attn_cp_rank,
        cp_size=storage.attn_cp_size,
        dcp_rank=storage.dcp_rank,
        dcp_size=storage.dcp_size,
        tp_lcm_size=int(storage.tp_lcm_size or 0),
        namespace=config.namespace,
    )
