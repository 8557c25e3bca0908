"""Builds the connector's scheduler side or worker side from vLLM's config (the only module
here that reads vLLM's config objects, besides the facade)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvconnect.store.client import StoreClient
from kvconnect.vllm.affinity import threads_on
from kvconnect.vllm.config import VllmConnectorConfig
from kvconnect.vllm.events import PoolEvents, RemovalPoller
from kvconnect.vllm.groups import FULL_ONLY, Group, GroupKind
from kvconnect.vllm.layout import RankLayout
from kvconnect.vllm.lookup import PoolLookups
from kvconnect.vllm.pd import LeaseKeeper, PrefillService
from kvconnect.vllm.pool import PROBE_TOKENS, StorePoolIndex, fleet_keys
from kvconnect.vllm.scheduler import ConnectorScheduler
from kvconnect.vllm.sidechannel import SideChannelClient
from kvconnect.vllm.stats import HeldBlocks, StatValue, StepStats
from kvconnect.vllm.worker import ConnectorWorker, EngineFormat


class SchedulerServices:
    """The threads and sockets of the scheduler side; closed together."""

    def __init__(self, config: VllmConnectorConfig) -> None:
        self._config = config
        self.prefill: PrefillService | None = None
        self.keeper: LeaseKeeper | None = None
        self.client: SideChannelClient | None = None
        self.store: StoreClient | None = None
        self.pool: PoolLookups | None = None
        self.events: PoolEvents | None = None
        """The pool's KV events (None: vLLM publishes no KV events, or no pool)."""
        self.removals: RemovalPoller | None = None
        self.stats = StepStats()
        """The scheduler side's stats (pool lookups) since vLLM last collected them."""
        self.held = HeldBlocks()
        self._reported = (0, 0, 0)  # lease expiries, renewals, held blocks last reported

    def set_layouts(self, layouts: dict[int, RankLayout]) -> None:
        """The workers' KV layouts, by TP rank."""
        if self.prefill is not None:
            self.prefill.set_layouts(layouts)
        if self.pool is not None:
            self.pool.index.keys = fleet_keys(namespace=self._config.namespace, layouts=layouts)
            self.pool.settle()

    def take_stats(self) -> dict[str, StatValue]:
        """The scheduler side's stats since the last call (vLLM's scheduler thread, once a
        step): pool lookups, and prefill's lease expiries, renewals and held blocks."""
        data = self.stats.take()
        if self.prefill is not None:
            expired, renewed, held = self.prefill.expired, self.prefill.renewed, self.held.total
            last_expired, last_renewed, last_held = self._reported
            if expired > last_expired:
                data["lease_expiries"] = expired - last_expired
            if renewed > last_renewed:
                data["lease_renewals"] = renewed - last_renewed
            if held != last_held:  # a level: reported when it changes
                data["prefill_held_blocks"] = held
            self._reported = (expired, renewed, held)
        return data

    def close(self) -> None:
        services = (self.keeper, self.prefill, self.client, self.pool, self.removals, self.store)
        for service in services:
            if service is not None:
                service.close()


def kv_cache_groups(kv_cache_config: Any) -> tuple[Group, ...]:
    """vLLM's KV-cache groups as the connector sees them (one full-attention group when vLLM
    gives no config)."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return FULL_ONLY
    groups: list[Group] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            groups.append(Group(GroupKind.SLIDING, spec.sliding_window))
        elif isinstance(spec, MambaSpec):
            groups.append(Group(GroupKind.STATE))
        else:  # full attention and its kinds (MLA, …): every block of the prefix
            groups.append(Group(GroupKind.FULL))
    return tuple(groups)


def layer_groups(kv_cache_config: Any) -> dict[str, int]:
    """The KV-cache group of every layer vLLM allocates KV for."""
    if kv_cache_config is None:
        return {}
    return {
        name: index
        for index, group in enumerate(kv_cache_config.kv_cache_groups)
        for name in group.layer_names
    }


def build_scheduler(
    config: VllmConnectorConfig, vllm_config: Any, kv_cache_config: Any
) -> tuple[ConnectorScheduler, SchedulerServices]:
    """The scheduler side, its services started (their threads on ``io_cpus`` if set)."""
    with threads_on(config.io_cpu_set):
        return _build_scheduler(config, vllm_config, kv_cache_config)


def _build_scheduler(
    config: VllmConnectorConfig, vllm_config: Any, kv_cache_config: Any
) -> tuple[ConnectorScheduler, SchedulerServices]:
    transfer = vllm_config.kv_transfer_config
    parallel = vllm_config.parallel_config
    services = SchedulerServices(config)
    token = config.cluster_token()
    try:
        if transfer.is_kv_producer:
            port = config.side_channel_port
            if port:
                port += getattr(parallel, "data_parallel_rank", 0) or 0
            services.prefill = PrefillService(
                transfer.engine_id, config.host, port, config.lease, token=token
            )
            services.prefill.start()
        if transfer.is_kv_consumer:
            services.client = SideChannelClient(config.rpc_timeout, token=token)
            services.keeper = LeaseKeeper(services.client, config.lease)
            services.keeper.start()
        if config.pool:
            services.store = StoreClient(config.store, config.transfer_config(token))
            services.store.start()
            index = StorePoolIndex(
                services.store,
                _probe_hash(vllm_config),
                groups=kv_cache_groups(kv_cache_config),
                block_size=vllm_config.cache_config.block_size,
            )
            services.pool = PoolLookups(index, cpus=config.io_cpu_set, stats=services.stats)
            if _publishes_kv_events(vllm_config):
                _start_pool_events(services, config, parallel.tensor_parallel_size)
    except BaseException:
        services.close()
        raise
    scheduler = ConnectorScheduler(
        engine_id=transfer.engine_id,
        host=config.host,
        tp_size=parallel.tensor_parallel_size,
        block_size=vllm_config.cache_config.block_size,
        prefill=services.prefill,
        keeper=services.keeper,
        pool=services.pool,
        groups=kv_cache_groups(kv_cache_config),
        save_generated=config.pool_save_generated,
    )
    return scheduler, services


def _probe_hash(vllm_config: Any) -> Callable[[], bytes | None]:
    """This instance's hash of the fleet probe's block (vLLM's hash algorithm and seed), None
    until vLLM seeded its hashes (its engine core does so after handing the connector the
    workers' layouts)."""

    def probe() -> bytes | None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils

        if getattr(kv_cache_utils, "NONE_HASH", None) is None:
            return None
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        return bytes(kv_cache_utils.hash_block_tokens(hash_fn, None, range(PROBE_TOKENS)))

    return probe


def _publishes_kv_events(vllm_config: Any) -> bool:
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


def _start_pool_events(
    services: SchedulerServices, config: VllmConnectorConfig, ranks: int
) -> None:
    """The pool's KV events: saves announced by the workers, removals polled from the master."""
    store, pool = services.store, services.pool
    assert store is not None
    assert pool is not None
    events = PoolEvents(ranks)
    services.events = events
    services.removals = RemovalPoller(
        store, lambda: pool.index.keys, events.removed, config.events_poll_interval
    )
    services.removals.start()


def build_worker(
    config: VllmConnectorConfig, vllm_config: Any, kv_cache_config: Any
) -> ConnectorWorker:
    """The worker side of this process's TP rank (started by ``register``)."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    backends = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})
    fmt = EngineFormat(
        model=model.model,
        dtype=f"{cache.cache_dtype}/{model.dtype}",
        block_size=cache.block_size,
        tp_rank=get_tensor_model_parallel_rank(),
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        engine=f"vllm {vllm.__version__}",
        revision=model.revision or "",
        attention_backend=",".join(backends),
        kv_layout=cache.get_resolved_kv_cache_layout().name,
        total_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
    )
    return ConnectorWorker(config, fmt, kv_cache_config.num_blocks, layer_groups(kv_cache_config))
