"""Drives vLLM's real ``Scheduler`` with kvconnect's connector and no model: a step is
``schedule()``, then ``update_from_output`` with what the workers would report."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvconnect.vllm.config import VllmConnectorConfig
from kvconnect.vllm.connector import KVConnectHandshake, KVConnectMetadata
from kvconnect.vllm.worker import ConnectorWorker, EngineFormat
from tests.support.waiting import wait_for

BLOCK = 16
EOS = 2


def make_scheduler(
    model: Path,
    role: str,
    extra: dict[str, Any],
    *,
    num_blocks: int = 64,
    policy: str = "fail",
    engine_id: str | None = None,
    transfer: Mapping[str, Any] | None = None,
    log_stats: bool = False,
    groups: str = "full",
) -> Scheduler:
    """A scheduler whose connector is kvconnect's (or what ``transfer`` says instead: fields
    of vLLM's ``KVTransferConfig``), with ``num_blocks`` KV blocks and the KV-cache groups of
    :func:`kv_cache_groups`."""
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32"),
        scheduler_config=SchedulerConfig(
            max_model_len=4096,
            is_encoder_decoder=False,
            max_num_seqs=8,
            max_num_batched_tokens=256,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK,
            enable_prefix_caching=True,
            # vLLM caches Mamba prefixes only in 'align' mode (states at block boundaries)
            mamba_cache_mode="align" if groups == "mamba" else "none",
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            **{
                "kv_connector": "KVConnectConnector",
                "kv_connector_module_path": "kvconnect.vllm.connector",
                "kv_role": role,
                "engine_id": engine_id,
                "kv_connector_extra_config": extra,
                "kv_load_failure_policy": policy,
                **(transfer or {}),
            }
        ),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=kv_cache_groups(groups),
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        log_stats=log_stats,
        block_size=BLOCK,
    )


WINDOW = 24  # tokens of the sliding-window group: its window spans 2 or 3 blocks


def kv_cache_groups(kind: str) -> list[KVCacheGroupSpec]:
    """KV-cache groups of a model: ``full`` (one full-attention layer), ``swa`` (a
    full-attention layer and a sliding-window one, like Gemma 3) or ``mamba`` (a
    full-attention layer and a Mamba one, like Granite 4)."""
    spec = {"num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
    groups = [KVCacheGroupSpec(["model.layers.0.attn"], FullAttentionSpec(BLOCK, **spec))]
    if kind == "swa":
        sliding = SlidingWindowSpec(BLOCK, sliding_window=WINDOW, **spec)
        groups.append(KVCacheGroupSpec(["model.layers.1.attn"], sliding))
    elif kind == "mamba":
        mamba = MambaSpec(
            BLOCK, shapes=((2, 4),), dtypes=(torch.float32,), mamba_cache_mode="align"
        )
        groups.append(KVCacheGroupSpec(["model.layers.1.mamba"], mamba))
    return groups


FORMAT = EngineFormat(model="m", dtype="float32", block_size=BLOCK, tp_rank=0, tp_size=1)
HEADS, HEAD_SIZE = 2, 4


def kv_caches(num_blocks: int, seed: int | None, layout: str = "NHD") -> dict[str, torch.Tensor]:
    """Two KV layers ``[K|V, blocks, ...]``, random (``seed``) or zeros: ``NHD`` is
    ``[.., tokens, heads, dim]``; ``HND`` is ``[.., heads, tokens, dim]``; ``HND-strides`` is
    HND in memory seen through NHD's shape (how vLLM permutes strides): the same block size
    in bytes, other bytes."""
    physical = (2, num_blocks, BLOCK, HEADS, HEAD_SIZE)
    if layout != "NHD":
        physical = (2, num_blocks, HEADS, BLOCK, HEAD_SIZE)
    generator = torch.Generator().manual_seed(seed or 0)
    caches = {}
    for i in range(2):
        tensor = (
            torch.randn(*physical, generator=generator)
            if seed is not None
            else torch.zeros(*physical)
        )
        caches[f"model.layers.{i}.attn"] = (
            tensor.transpose(2, 3) if layout == "HND-strides" else tensor
        )
    return caches


STATE_BYTES = 32  # the Mamba group's state per block: MambaSpec shapes ((2, 4),) float32


def hybrid_caches(num_blocks: int, seed: int | None, groups: str) -> dict[str, torch.Tensor]:
    """The layers of :func:`kv_cache_groups` ``groups``, random (``seed``) or zeros, as
    vLLM 0.33 hands them to ``register_kv_caches``: attention layers as in
    :func:`kv_caches`, a Mamba layer as one int8 ``[blocks, 1, 1, state bytes]`` view."""
    caches = kv_caches(num_blocks, seed)
    if groups != "mamba":
        return caches
    generator = torch.Generator().manual_seed(seed or 0)
    shape = (num_blocks, 1, 1, STATE_BYTES)
    del caches["model.layers.1.attn"]
    caches["model.layers.1.mamba"] = (
        torch.randint(-128, 128, shape, generator=generator, dtype=torch.int8)
        if seed is not None
        else torch.zeros(shape, dtype=torch.int8)
    )
    return caches


def layer_groups(groups: str) -> dict[str, int]:
    """The KV-cache group of each layer of :func:`kv_cache_groups` ``groups``."""
    specs = kv_cache_groups(groups)
    return {name: g for g, spec in enumerate(specs) for name in spec.layer_names}


@contextmanager
def kv_worker(
    num_blocks: int = 64,
    seed: int | None = None,
    layout: str = "NHD",
    fmt: EngineFormat = FORMAT,
    groups: str = "full",
    extra: Mapping[str, Any] | None = None,
) -> Iterator[tuple[ConnectorWorker, dict[str, torch.Tensor]]]:
    """A real worker side (transfer engine over TCP) with :func:`kv_caches` registered (or
    :func:`hybrid_caches` of ``groups``), as ``make_scheduler``'s workers would have;
    ``extra``: more connector settings."""
    caches = (
        kv_caches(num_blocks, seed, layout)
        if groups == "full"
        else hybrid_caches(num_blocks, seed, groups)
    )
    worker = ConnectorWorker(
        VllmConnectorConfig.from_mapping(
            {"transport": "tcp", "read_timeout": 5.0, "rpc_timeout": 2.0, **(extra or {})}
        ),
        fmt,
        num_blocks,
        layer_groups(groups),
    )
    try:
        worker.register(caches)
        yield worker, caches
    finally:
        worker.close()


def handshake(scheduler: Scheduler, worker: ConnectorWorker) -> None:
    """What vLLM's engine core does at start: hand the workers' layouts to the scheduler
    side (one worker, TP rank 0)."""
    assert worker.layout is not None
    layout = KVConnectHandshake(msgspec.msgpack.encode(worker.layout))
    scheduler.connector.set_xfer_handshake_metadata({0: layout})


def make_request(
    request_id: str,
    tokens: list[int],
    *,
    max_tokens: int = 4,
    params: dict[str, Any] | None = None,
) -> Request:
    init_none_hash(sha256)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sampling.extra_args = {"kv_transfer_params": params} if params is not None else None
    return Request(
        request_id,
        tokens,
        sampling,
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def step(scheduler: Scheduler, **kwargs: Any) -> tuple[SchedulerOutput, dict[str, Any]]:
    """One step (see :func:`run`); returns the scheduler output and the engine-core outputs
    by request id."""
    output, outputs = run(scheduler, **kwargs)
    return output, {o.request_id: o for eo in outputs.values() for o in eo.outputs}


def run(
    scheduler: Scheduler,
    *,
    sending: Iterable[str] = (),
    recving: Iterable[str] = (),
    failed: Iterable[str] = (),
    invalid: Iterable[int] = (),
    token: int = 7,
    worker: ConnectorWorker | None = None,
    stats: KVConnectorStats | None = None,
) -> tuple[SchedulerOutput, dict[int, EngineCoreOutputs]]:
    """One step: schedule, then report a sampled ``token`` for every scheduled request that
    finished its prompt, plus the given transfer results, or with a ``worker`` the results of
    that real worker side running the step's plan (as vLLM's model runner calls it), and the
    workers' connector ``stats``. Returns the scheduler output and vLLM's engine-core outputs
    (with ``log_stats``, one of them carries the statistics for the front end)."""
    output = scheduler.schedule()
    if worker is not None:
        plan = plan_of(output)
        worker.start(plan)
        worker.save(plan)
        sending, recving, failed = worker.results(output.finished_req_ids)
        invalid = worker.load_errors()
    ids = list(output.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        request = scheduler.requests[rid]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([token] if done else [])
    runner = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=sampled,
        kv_connector_output=KVConnectorOutput(
            finished_sending=set(sending) or None,
            finished_recving=set(recving) or None,
            failed_recving=set(failed),
            invalid_block_ids=set(invalid),
            kv_connector_stats=stats,
        ),
    )
    return output, scheduler.update_from_output(output, runner)


def settle_lookups(scheduler: Scheduler) -> None:
    """Wait until kvconnect's background pool lookups are in (vLLM skips a request while its
    lookup runs and asks again at the next step)."""
    lookups = scheduler.connector._services.pool
    wait_for(lambda: not lookups.busy(), "the pool lookup did not finish")


def plan_of(output: SchedulerOutput) -> Any:
    """kvconnect's plan for the step (``StepPlan``), also inside vLLM's MultiConnector."""
    meta = output.kv_connector_metadata
    for child in getattr(meta, "metadata", (meta,)):
        if isinstance(child, KVConnectMetadata):
            return child.plan
    raise AssertionError(f"no kvconnect plan in {meta!r}")


def assert_empty(scheduler: Scheduler) -> None:
    """No request, no queued work and every block free again."""
    assert not scheduler.requests
    assert not scheduler.running
    assert len(scheduler.waiting) == 0
    assert not scheduler.finished_recving_kv_req_ids
    pool = scheduler.kv_cache_manager.block_pool
    # the null block is never free
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
