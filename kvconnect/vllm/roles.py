"""Builds the connector's scheduler side or worker side from vLLM's config (the only module
here that reads vLLM's config objects, besides the facade)."""

from __future__ import annotations

from typing import Any

from kvconnect.store.client import StoreClient
from kvconnect.vllm.affinity import threads_on
from kvconnect.vllm.config import VllmConnectorConfig
from kvconnect.vllm.events import PoolEvents, RemovalPoller
from kvconnect.vllm.layout import RankLayout
from kvconnect.vllm.pd import LeaseKeeper, PrefillService
from kvconnect.vllm.pool import StorePoolIndex, pool_keys
from kvconnect.vllm.scheduler import ConnectorScheduler
from kvconnect.vllm.sidechannel import SideChannelClient
from kvconnect.vllm.stats import HeldBlocks, MeasuredPoolIndex, StatValue, StepStats
from kvconnect.vllm.worker import ConnectorWorker, EngineFormat


class SchedulerServices:
    """The threads and sockets of the scheduler side; closed together."""

    def __init__(self, config: VllmConnectorConfig, model: str) -> None:
        self._config = config
        self._model = model
        self.prefill: PrefillService | None = None
        self.keeper: LeaseKeeper | None = None
        self.client: SideChannelClient | None = None
        self.store: StoreClient | None = None
        self.pool: StorePoolIndex | None = None
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
        if self.pool is not None:  # a hit needs the blocks of every rank
            self.pool.keys = tuple(
                pool_keys(
                    namespace=self._config.namespace,
                    model=self._model,
                    compat=layout.compat,
                    tp_rank=rank,
                    layers=len(layout.layers),
                    chunks=layout.layers[0].chunks if layout.layers else 1,
                )
                for rank, layout in sorted(layouts.items())
            )

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
        for service in (self.keeper, self.prefill, self.client, self.removals, self.store):
            if service is not None:
                service.close()


def build_scheduler(
    config: VllmConnectorConfig, vllm_config: Any
) -> tuple[ConnectorScheduler, SchedulerServices]:
    """The scheduler side, its services started (their threads on ``io_cpus`` if set)."""
    with threads_on(config.io_cpu_set):
        return _build_scheduler(config, vllm_config)


def _build_scheduler(
    config: VllmConnectorConfig, vllm_config: Any
) -> tuple[ConnectorScheduler, SchedulerServices]:
    transfer = vllm_config.kv_transfer_config
    parallel = vllm_config.parallel_config
    services = SchedulerServices(config, vllm_config.model_config.model)
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
            services.pool = StorePoolIndex(services.store)
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
        pool=MeasuredPoolIndex(services.pool, services.stats) if services.pool else None,
    )
    return scheduler, services


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
        store, lambda: pool.keys, events.removed, config.events_poll_interval
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
    )
    return ConnectorWorker(config, fmt, kv_cache_config.num_blocks)
