"""The connector's worker side: registers the KV cache, reads prefill's blocks (decode),
reports when held blocks may go (prefill), loads and saves pool blocks.

Runs in each vLLM worker process (one per TP rank). vLLM calls it on its model-runner thread
and never waits on it: reads, loads and saves run in the background and their results are
collected at the end of each step. They run in lanes (:mod:`kvconnect.vllm.lanes`): the reads
from each prefill engine, the pool's loads and the pool's saves each have threads of their
own, so a prefill that hangs delays only the reads from it.

A transfer that cannot be stopped by its deadline (the transfer engine reports it PENDING,
the store UNSETTLED) still writes (read, load) or reads (save) vLLM's blocks: its request is
reported only once the transfer settled, so vLLM keeps the blocks until then.
"""

from __future__ import annotations

import enum
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvconnect.errors import ConfigError, KVConnectError
from kvconnect.store.client import StoreClient
from kvconnect.store.messages import Code
from kvconnect.transfer import TransferOp, TransferRequest, TransferStatus
from kvconnect.transfer.engine import TransferEngine
from kvconnect.transfer.memory import MemoryRegion
from kvconnect.vllm import messages as msg
from kvconnect.vllm.affinity import lower_switch_interval, threads_on
from kvconnect.vllm.config import VllmConnectorConfig
from kvconnect.vllm.kvcache import register_kv_caches
from kvconnect.vllm.lanes import Lanes
from kvconnect.vllm.layout import (
    IncompatiblePeer,
    KVFormat,
    LayerLayout,
    RankLayout,
    block_runs,
    check_compatible,
    compat_hash,
    range_pairs,
)
from kvconnect.vllm.plan import PoolJob, RecvJob, StepPlan
from kvconnect.vllm.pool import PoolKeys, pool_keys
from kvconnect.vllm.sidechannel import SideChannelClient
from kvconnect.vllm.trace import Phase, ReadTrace

log = logging.getLogger(__name__)

_LANE_THREADS = 4  # threads of one lane: the reads from one prefill, pool loads, pool saves
_LOADS = "pool-load"
_SAVES = "pool-save"


@dataclass(frozen=True, slots=True)
class EngineFormat:
    """What this engine's blocks are, besides the layout of memory."""

    model: str
    dtype: str
    block_size: int
    tp_rank: int
    tp_size: int
    engine: str = ""
    revision: str = ""
    attention_backend: str = ""
    kv_layout: str = ""

    def kv_format(self) -> KVFormat:
        """The format every rank of this engine shares (the TP rank is not part of it)."""
        return KVFormat(
            engine=self.engine,
            model=self.model,
            revision=self.revision,
            dtype=self.dtype,
            block_size=self.block_size,
            tp_size=self.tp_size,
            attention_backend=self.attention_backend,
            kv_layout=self.kv_layout,
        )


class _Kind(enum.StrEnum):
    """What a background job of the worker does (its value names it in logs)."""

    RECV = "recv"  # decode: read a prefill engine's blocks
    LOAD = "load"  # pool: load blocks from the store
    SAVE = "save"  # pool: save blocks to the store


class _Hold(enum.Enum):
    """What a finished request's blocks still wait for before they are reported sent."""

    LEASE = enum.auto()  # prefill: decode has neither read nor given them up (the lease)
    SAVE = enum.auto()  # pool: their save still reads them


@dataclass(slots=True)
class _Outcome:
    request_id: str
    kind: _Kind
    ok: bool
    failed_blocks: tuple[int, ...] = ()
    nbytes: int = 0
    seconds: float = 0.0
    io_seconds: float = 0.0  # the data movement alone (the batched READ)
    refused: bool = False  # the peer's KV format differs: nothing was read
    trace: ReadTrace | None = None  # a read's phases (stats and a debug line once collected)


@dataclass(slots=True)
class WorkerStats:
    """Counters since the last report (vLLM collects them every step)."""

    data: dict[str, float] = field(default_factory=dict)

    def add(self, **values: float) -> None:
        for key, value in values.items():
            self.data[key] = self.data.get(key, 0) + value

    def take(self) -> dict[str, float]:
        data, self.data = self.data, {}
        return data


class ConnectorWorker:
    """Worker-side state of one TP rank."""

    def __init__(self, config: VllmConnectorConfig, fmt: EngineFormat, num_blocks: int) -> None:
        self.config = config
        self.format = fmt
        self._num_blocks = num_blocks
        token = config.cluster_token()
        self.engine = TransferEngine(config.transfer_config(token))
        self._client = SideChannelClient(config.rpc_timeout, token=token)
        self._store: StoreClient | None = None
        self._pool_keys: PoolKeys | None = None
        self._lanes = Lanes(
            "vllm", _LANE_THREADS, cpus=config.io_cpu_set, on_exit=self._client.release
        )
        self._outcomes: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        self._reported = threading.Event()  # an outcome came since results() last looked
        self._reading = 0  # PD reads and pool loads not yet collected (vLLM's thread only)
        self._lock = threading.Lock()
        self._peers: dict[str, msg.LayoutReply] = {}
        self._refused: dict[str, str] = {}  # prefill engine → why its KV is never read
        self.layout: RankLayout | None = None
        self._regions: dict[int, MemoryRegion] = {}
        self._load_errors: set[int] = set()
        self._holds: dict[str, set[_Hold]] = {}  # finished request → what its blocks wait for
        self._saves: dict[str, bool] = {}  # request → its save is done
        self._saving: dict[str, threading.Event] = {}  # saves not reported yet, by request
        self._cuda = False
        self.stats = WorkerStats()

    # -------------------------------------------------------------------------- set-up

    def register(self, kv_caches: Mapping[str, Any]) -> RankLayout:
        """Register the paged KV tensors and start the engine; returns this rank's layout."""
        lower_switch_interval(self.config.gil_switch_interval)
        with threads_on(self.config.io_cpu_set):
            self.engine.start()
        layers, self._regions = register_kv_caches(self.engine, kv_caches, self._num_blocks)
        self._cuda = any(getattr(t, "is_cuda", False) for t in kv_caches.values())
        kv_format = self.format.kv_format()
        compat = compat_hash(kv_format, layers)
        self.layout = RankLayout(self.engine.name, compat, tuple(layers), kv_format)
        if self.config.pool:
            with threads_on(self.config.io_cpu_set):
                self._start_pool(layers)
        log.info(
            "kvconnect registered %d KV layers (%d blocks) as segment %s",
            len(layers),
            self._num_blocks,
            self.engine.name,
        )
        return self.layout

    def _start_pool(self, layers: list[LayerLayout]) -> None:
        assert self.layout is not None
        cfg = self.config
        self._pool_keys = pool_keys(
            namespace=cfg.namespace,
            model=self.format.model,
            compat=self.layout.compat,
            tp_rank=self.format.tp_rank,
            layers=len(layers),
            chunks=layers[0].chunks if layers else 1,
        )
        store = StoreClient(cfg.store, engine=self.engine)
        store.start()
        self._store = store

    def close(self) -> None:
        """Stop the lanes (waiting for running jobs), then the engine. Idempotent."""
        self._lanes.close()
        if self._store is not None:
            self._store.close()
        self._client.close()
        self.engine.close()

    # ---------------------------------------------------------------------------- steps

    def start(self, plan: StepPlan) -> None:
        """Start this step's reads and loads (never blocks)."""
        if plan.recv or plan.load or plan.released:
            log.debug(
                "step: %d reads, %d loads, released %s",
                len(plan.recv),
                len(plan.load),
                plan.released,
            )
        for job in plan.recv:
            lane = f"read-{job.remote.endpoint}"
            recv = functools.partial(self._recv, trace=ReadTrace.begin())
            self._lanes.submit(lane, self._guarded(_Kind.RECV, recv, job))
            self._reading += 1
        for load in plan.load:
            self._lanes.submit(_LOADS, self._guarded(_Kind.LOAD, self._load, load))
            self._reading += 1
        for rid in plan.held:
            self._holds.setdefault(rid, set()).add(_Hold.LEASE)
        for rid in plan.released:  # held in this plan or an earlier one
            self._release(rid, _Hold.LEASE)

    def save(self, plan: StepPlan) -> None:
        """Start this step's saves; the forward pass that wrote the blocks has run."""
        if plan.save and self._cuda:
            import torch  # saves read the device memory the step's kernels wrote

            torch.cuda.current_stream().synchronize()
        for job in plan.save:
            self._saves[job.request_id] = False
            with self._lock:
                self._saving[job.request_id] = threading.Event()
            self._lanes.submit(_SAVES, self._guarded(_Kind.SAVE, self._save, job))

    def protect(self, plan: StepPlan) -> None:
        """Before the forward pass: wait until the saves of requests preempted this step
        stopped reading their blocks (vLLM reuses them right away). Bounded by the saves'
        deadline (and a second): a save whose transfer has not settled by then keeps
        reading blocks the forward pass overwrites, but it is failing and stores nothing."""
        with self._lock:
            saving = [self._saving[rid] for rid in plan.preempted if rid in self._saving]
        end = time.monotonic() + self.config.pool_write_timeout + 1
        for settled in saving:
            if not settled.wait(max(0.0, end - time.monotonic())):
                log.warning("a preempted request's save still reads its blocks")
                return

    def results(self, finished: Iterable[str]) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` of this step.
        ``finished``: requests the scheduler finished this step."""
        for rid in finished:  # a finished request with a save waits for it, if it runs
            if rid in self._saves:
                waits = self._holds.setdefault(rid, set())
                if not self._saves[rid]:
                    waits.add(_Hold.SAVE)
        recving: set[str] = set()
        failed: set[str] = set()
        self._reported.clear()  # before draining: a later outcome sets it again
        while True:
            try:
                outcome = self._outcomes.get_nowait()
            except queue.Empty:
                break
            self._account(outcome)
            if outcome.kind is _Kind.SAVE:
                self._saves[outcome.request_id] = True
                self._release(outcome.request_id, _Hold.SAVE)
                continue
            recving.add(outcome.request_id)
            self._reading -= 1  # a read's or a load's (saves went on above)
            if outcome.trace is not None:
                self._collected(outcome, outcome.trace)
            if not outcome.ok:
                failed.add(outcome.request_id)
                self._load_errors.update(outcome.failed_blocks)
        sending = {rid for rid, waits in self._holds.items() if not waits}
        for rid in sending:
            del self._holds[rid]
            self._saves.pop(rid, None)
        return sending, recving, failed

    def idle(self, plan: StepPlan) -> None:
        """Before :meth:`results` of a step: if vLLM scheduled nothing (``plan.idle``) while
        this worker reads or loads KV or holds blocks (for decode or a save), wait until a
        transfer reports, at most ``idle_wait``, so vLLM's worker, which would poll for its
        next step meanwhile, leaves the CPU and the GIL to the transfer threads. Never waits
        otherwise."""
        if plan.idle and (self._reading or self._holds):
            self._reported.wait(self.config.idle_wait)

    def _collected(self, outcome: _Outcome, trace: ReadTrace) -> None:
        """vLLM took a read's result: its trace is complete."""
        trace.stamp(Phase.COLLECT)
        self.stats.add(**trace.stats())
        if log.isEnabledFor(logging.DEBUG):
            log.debug(trace.line(outcome.request_id, outcome.nbytes, outcome.ok))

    def load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _release(self, rid: str, hold: _Hold) -> None:
        waits = self._holds.get(rid)
        if waits is not None:
            waits.discard(hold)

    def _account(self, outcome: _Outcome) -> None:
        if outcome.kind is _Kind.RECV:
            self.stats.add(
                pd_reads=1,
                pd_failed=0 if outcome.ok else 1,
                pd_bytes=outcome.nbytes,
                pd_seconds=outcome.seconds,
                pd_read_seconds=outcome.io_seconds,
                pd_incompatible=1 if outcome.refused else 0,
            )
        elif outcome.kind is _Kind.LOAD:
            self.stats.add(
                pool_loads=1,
                pool_failed=0 if outcome.ok else 1,
                pool_bytes_loaded=outcome.nbytes,
                pool_load_seconds=outcome.seconds,
            )
        else:
            self.stats.add(pool_saves=1, pool_bytes_saved=outcome.nbytes)

    def _guarded(
        self, kind: _Kind, job: Callable[[Any], None], item: RecvJob | PoolJob
    ) -> Callable[[], None]:
        """``job(item)`` as a lane job that always reports an outcome of ``kind``."""
        return functools.partial(self._guard, kind, job, item)

    def _guard(self, kind: _Kind, job: Callable[[Any], None], item: RecvJob | PoolJob) -> None:
        # A job must always produce an outcome, or vLLM would wait for its request for ever.
        try:
            job(item)
        except Exception:  # reported as a failed transfer
            log.exception("kvconnect %s of %s failed", kind, item.request_id)
            blocks = item.local_blocks if isinstance(item, RecvJob) else item.blocks
            self._report(_Outcome(item.request_id, kind, False, tuple(blocks)))

    def _report(self, outcome: _Outcome) -> None:
        """Hand ``outcome`` to the next :meth:`results` (any thread; for a transfer that had
        not settled, the transport thread that settles it)."""
        self._outcomes.put(outcome)
        self._reported.set()
        if outcome.kind is _Kind.SAVE:
            with self._lock:
                settled = self._saving.pop(outcome.request_id, None)
            if settled is not None:
                settled.set()

    def _report_settled(
        self, outcome: _Outcome, unsettled: bool, on_settled: Callable[[Callable[[], None]], None]
    ) -> None:
        """Report ``outcome`` once no transfer touches its blocks any more: at once unless
        ``unsettled``; ``on_settled`` registers the report (``add_settled_callback`` of the
        transfer batch, ``on_settled`` of the store's result)."""
        if unsettled:
            log.error(
                "kvconnect %s of %s could not be stopped by its deadline: its blocks stay "
                "with kvconnect until the transfer lets go",
                outcome.kind,
                outcome.request_id,
            )
        on_settled(functools.partial(self._report, outcome))

    # ------------------------------------------------------------------------------ PD

    def _recv(self, job: RecvJob, trace: ReadTrace) -> None:
        trace.stamp(Phase.QUEUE)
        started = time.monotonic()
        remote = job.remote
        mine = self.layout
        assert mine is not None
        try:
            theirs = self._peer_layout(remote.endpoint, remote.engine_id, remote.tp_size)
        except KVConnectError as exc:
            refused = isinstance(exc, IncompatiblePeer)  # logged once per prefill engine
            if not refused:
                log.error("cannot read KV of %s from %s: %s", job.request_id, remote.endpoint, exc)
            seconds = time.monotonic() - started
            blocks = job.local_blocks
            outcome = _Outcome(
                job.request_id, _Kind.RECV, False, blocks, 0, seconds, refused=refused
            )
            outcome.trace = trace
            self._report(outcome)
            self._give_up(remote.endpoint, remote.request_id)
            return
        trace.stamp(Phase.LAYOUT)
        requests = self._read_requests(mine, theirs, job)
        nbytes = sum(r.length for r in requests)
        trace.stamp(Phase.PLAN)
        reading = time.monotonic()
        timeout = started + self.config.read_timeout - time.monotonic()
        batch = self.engine.submit(TransferOp.READ, requests, timeout=timeout)
        statuses = batch.wait()
        io_seconds = time.monotonic() - reading
        trace.stamp(Phase.READ)
        read = all(s is TransferStatus.COMPLETED for s in statuses)
        ok = read and self._confirm(remote.endpoint, remote.request_id, job.request_id)
        trace.stamp(Phase.CONFIRM)
        seconds = time.monotonic() - started
        failed = () if ok else job.local_blocks
        moved = nbytes if ok else 0
        # Reported before telling prefill, so a dead prefill delays no recompute.
        outcome = _Outcome(
            job.request_id, _Kind.RECV, ok, failed, moved, seconds, io_seconds, trace=trace
        )
        unsettled = TransferStatus.PENDING in statuses
        self._report_settled(outcome, unsettled, batch.add_settled_callback)
        if not read:
            with self._lock:  # a restarted prefill may reuse its engine id: ask again next time
                self._peers.pop(remote.engine_id, None)
            errors = [e for e in batch.errors if e is not None]
            problem = errors[0] if errors else statuses
            log.error(
                "reading KV of %s from %s failed: %s", job.request_id, theirs.segment, problem
            )
            self._give_up(remote.endpoint, remote.request_id)

    def _read_requests(
        self, mine: RankLayout, theirs: RankLayout, job: RecvJob
    ) -> list[TransferRequest]:
        runs = block_runs(job.local_blocks, job.remote_blocks)
        requests: list[TransferRequest] = []
        for local, remote in zip(mine.layers, theirs.layers, strict=True):
            region = self._regions[local.region]
            for lo, ro, length in range_pairs(local, remote, runs):
                requests.append(
                    TransferRequest(region, lo, theirs.segment, remote.region, ro, length)
                )
        return requests

    def _peer_layout(self, endpoint: str, engine_id: str, tp_size: int) -> RankLayout:
        """The prefill rank this rank reads from (asked once per prefill engine). Raises
        IncompatiblePeer when that engine's KV means something else here: decided and logged
        once per engine, at first contact."""
        with self._lock:
            reply = self._peers.get(engine_id)
            refusal = self._refused.get(engine_id)
        if refusal is not None:
            raise IncompatiblePeer(refusal)
        if reply is None:
            answer = self._client.call(endpoint, msg.GetLayout())
            if not isinstance(answer, msg.LayoutReply):
                raise ConfigError(f"prefill {endpoint} has no KV layout to offer: {answer!r}")
            reply = answer
            if reply.engine_id != engine_id:
                raise ConfigError(
                    f"{endpoint} is engine {reply.engine_id}, not {engine_id} (restarted?)"
                )
            with self._lock:
                self._peers[engine_id] = reply
        assert self.layout is not None
        if tp_size != self.format.tp_size or len(reply.ranks) != self.format.tp_size:
            theirs_tp = f"{tp_size} ({len(reply.ranks)} ranks)"
            self._refuse(engine_id, f"tp_size: {theirs_tp} at the peer, {self.format.tp_size} here")
        theirs = reply.ranks[self.format.tp_rank]
        problem = check_compatible(self.layout, theirs)
        if problem is not None and self.config.enforce_compat:
            self._refuse(engine_id, problem)
        return theirs

    def _refuse(self, engine_id: str, problem: str) -> None:
        refusal = f"prefill engine {engine_id} has an incompatible KV format ({problem})"
        with self._lock:
            first = engine_id not in self._refused
            self._refused[engine_id] = refusal
        if first:
            log.error(
                "%s: reading none of its KV; its requests are recomputed (or fail, per "
                "kv_load_failure_policy)",
                refusal,
            )
        raise IncompatiblePeer(refusal)

    def _confirm(self, endpoint: str, remote_id: str, rid: str) -> bool:
        try:
            reply = self._client.call(endpoint, msg.Confirm(remote_id, self.format.tp_rank))
        except KVConnectError as exc:
            log.error("could not confirm the read of %s with prefill: %s", rid, exc)
            return False
        if isinstance(reply, msg.Ack) and reply.ok:
            return True
        log.error("prefill refused the read of %s (%s): recomputing or failing it", rid, reply)
        return False

    def _give_up(self, endpoint: str, remote_id: str) -> None:
        try:
            self._client.call(endpoint, msg.GiveUp([remote_id]))
        except KVConnectError as exc:  # its lease lapses on its own
            log.warning("could not tell prefill to free %s: %s", remote_id, exc)

    # ---------------------------------------------------------------------------- pool

    def _pool_ranges(
        self, job: PoolJob
    ) -> tuple[list[str], list[MemoryRegion], list[int], list[int]]:
        assert self.layout is not None
        assert self._pool_keys is not None
        keys: list[str] = []
        regions: list[MemoryRegion] = []
        offsets: list[int] = []
        sizes: list[int] = []
        for block_hash, block in zip(job.hashes, job.blocks, strict=True):
            keys.extend(self._pool_keys.block_keys(block_hash))
            for layer in self.layout.layers:
                for chunk in range(layer.chunks):
                    regions.append(self._regions[layer.region])
                    offsets.append(layer.block_offset(chunk, block))
                    sizes.append(layer.block_bytes)
        return keys, regions, offsets, sizes

    def _load(self, job: PoolJob) -> None:
        assert self._store is not None
        assert self._pool_keys is not None
        started = time.monotonic()
        keys, regions, offsets, sizes = self._pool_ranges(job)
        result = self._store.batch_get_into(
            keys, regions, offsets, sizes, timeout=self.config.pool_read_timeout
        )
        per_block = self._pool_keys.per_block
        ok = result.ok()
        failed = tuple(
            block
            for i, block in enumerate(job.blocks)
            if not all(ok[i * per_block : (i + 1) * per_block])
        )
        seconds = time.monotonic() - started
        outcome = _Outcome(
            job.request_id, _Kind.LOAD, not failed, failed, sum(result.sizes), seconds
        )
        self._report_settled(outcome, Code.UNSETTLED in result.codes, result.on_settled)

    def _save(self, job: PoolJob) -> None:
        assert self._store is not None
        keys, regions, offsets, sizes = self._pool_ranges(job)
        result = self._store.batch_put_from(
            keys, regions, offsets, sizes, timeout=self.config.pool_write_timeout
        )
        written = sum(size for size, ok in zip(sizes, result.ok(), strict=True) if ok)
        outcome = _Outcome(job.request_id, _Kind.SAVE, all(result.ok()), (), written)
        self._report_settled(outcome, Code.UNSETTLED in result.codes, result.on_settled)
