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
from dataclasses import dataclass
from typing import Any, Protocol, cast

from kvconnect.errors import KVConnectError
from kvconnect.store.client import Span, StoreClient
from kvconnect.store.messages import Code
from kvconnect.transfer import TransferOp, TransferRequest, TransferStatus
from kvconnect.transfer.engine import TransferEngine
from kvconnect.transfer.memory import MemoryRegion
from kvconnect.vllm import messages as msg
from kvconnect.vllm.affinity import lower_switch_interval, threads_on
from kvconnect.vllm.config import VllmConnectorConfig
from kvconnect.vllm.groups import NULL_BLOCK, GroupBlocks
from kvconnect.vllm.kvcache import register_kv_caches
from kvconnect.vllm.lanes import Lanes
from kvconnect.vllm.layout import (
    IncompatiblePeer,
    KVFormat,
    LayerLayout,
    RankLayout,
    check_compatible,
    compat_hash,
    range_pairs,
)
from kvconnect.vllm.peers import PeerLayouts, PeerReplaced
from kvconnect.vllm.plan import PoolJob, RecvJob, StepPlan
from kvconnect.vllm.pool import BlockPart, PoolKeys, block_part, block_spans, pool_keys
from kvconnect.vllm.sidechannel import SideChannelClient
from kvconnect.vllm.stats import StepStats
from kvconnect.vllm.tpmap import (
    KV_HALVES_BACKENDS,
    check_mappable,
    layer_spans,
    with_heads,
)
from kvconnect.vllm.trace import Phase, ReadTrace

log = logging.getLogger(__name__)

_LANE_THREADS = 4  # threads of one lane: the reads from one prefill, pool loads, pool saves
_LOADS = "pool-load"
_SAVES = "pool-save"


class Fence(Protocol):
    """Work queued on a device stream up to a point (a ``torch.cuda.Event``)."""

    def synchronize(self) -> None:
        """Block until that work is done."""


def record_fence() -> Fence:
    """An event recorded on the current CUDA stream (the model's, in ``wait_for_save``)."""
    import torch

    cuda: Any = torch.cuda  # torch's CUDA API is partly untyped
    event = cuda.Event()
    event.record(cuda.current_stream())
    return cast(Fence, event)


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
    total_kv_heads: int = 0
    """The model's KV heads (1 for MLA); 0: unknown, so only identical peers are read."""

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


def _heads(layer: LayerLayout) -> str:
    """Which of the model's KV heads ``layer`` holds, for the log."""
    if not layer.total_heads:
        return "unknown"
    count = layer.block_shape[0]
    return f"{layer.first_head}-{layer.first_head + count - 1} of {layer.total_heads}"


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
    saved: tuple[str, ...] = ()  # a save's blocks (hashes) whose every object was stored
    trace: ReadTrace | None = None  # a read's phases (stats and a debug line once collected)


class ConnectorWorker:
    """Worker-side state of one TP rank."""

    def __init__(
        self,
        config: VllmConnectorConfig,
        fmt: EngineFormat,
        num_blocks: int,
        layer_groups: Mapping[str, int] | None = None,
    ) -> None:
        """``layer_groups``: the KV-cache group of each layer (absent: group 0)."""
        self.config = config
        self.format = fmt
        self._num_blocks = num_blocks
        self._layer_groups = dict(layer_groups or {})
        token = config.cluster_token()
        self.engine = TransferEngine(config.transfer_config(token))
        self._client = SideChannelClient(config.rpc_timeout, token=token)
        self._store: StoreClient | None = None
        self._pool_keys: PoolKeys | None = None
        # The pool: per KV-cache group, its layers and this rank's part of the group's objects.
        self._group_parts: dict[int, tuple[tuple[LayerLayout, ...], BlockPart]] = {}
        self._lanes = Lanes(
            "vllm", _LANE_THREADS, cpus=config.io_cpu_set, on_exit=self._client.release
        )
        self._outcomes: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        self._reported = threading.Event()  # an outcome came since results() last looked
        self._reading = 0  # PD reads and pool loads not yet collected (vLLM's thread only)
        self._lock = threading.Lock()
        self.peers = PeerLayouts(self._client, on_evict=self._forget_peer)
        self._mapped: set[str] = set()  # prefill engines read through tpmap (logged once)
        self.layout: RankLayout | None = None
        self._regions: dict[int, MemoryRegion] = {}
        self._load_errors: set[int] = set()
        self._holds: dict[str, set[_Hold]] = {}  # finished request → what its blocks wait for
        self._saves: dict[str, int] = {}  # request with a save → its saves still running
        self._saving: dict[str, threading.Event] = {}  # saves not reported yet, by request
        self._cuda = False
        self._saved: list[str] = []  # blocks saved whole since the last take_saved
        self.stats = StepStats()
        """Counters and series since vLLM last collected them (every step)."""

    # -------------------------------------------------------------------------- set-up

    def register(self, kv_caches: Mapping[str, Any]) -> RankLayout:
        """Register the paged KV tensors and start the engine; returns this rank's layout."""
        lower_switch_interval(self.config.gil_switch_interval)
        with threads_on(self.config.io_cpu_set):
            self.engine.start()
        layers, self._regions = register_kv_caches(
            self.engine, kv_caches, self._num_blocks, self._layer_groups
        )
        fmt = self.format
        halves = bool(KV_HALVES_BACKENDS & set(fmt.attention_backend.split(",")))
        layers = [
            with_heads(
                layer,
                fmt.tp_rank,
                fmt.tp_size,
                fmt.total_kv_heads,
                fmt.block_size,
                kv_halves=halves,
            )
            for layer in layers
        ]
        self._cuda = any(getattr(t, "is_cuda", False) for t in kv_caches.values())
        kv_format = self.format.kv_format()
        compat = compat_hash(kv_format, layers)
        self.layout = RankLayout(self.engine.name, compat, tuple(layers), kv_format)
        if self.config.pool:
            with threads_on(self.config.io_cpu_set):
                self._start_pool(layers)
        log.info(
            "kvconnect registered %d KV layers (%d blocks, KV heads %s) in %d KV-cache groups "
            "as segment %s",
            len(layers),
            self._num_blocks,
            _heads(layers[0]) if layers else "none",
            len({layer.group for layer in layers}),
            self.engine.name,
        )
        return self.layout

    def _start_pool(self, layers: list[LayerLayout]) -> None:
        assert self.layout is not None
        cfg = self.config
        self._pool_keys = pool_keys(
            namespace=cfg.namespace, model=self.format.model, compat=self.layout.compat
        )
        by_group: dict[int, list[LayerLayout]] = {}
        for layer in layers:
            by_group.setdefault(layer.group, []).append(layer)
        self._group_parts = {
            group: (tuple(members), block_part(members, self.format.tp_rank, self.format.tp_size))
            for group, members in sorted(by_group.items())
        }
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
        """Start this step's saves, after the forward pass that wrote the blocks: on CUDA its
        kernels are only queued, so the save waits (on its I/O thread, never here) for an
        event recorded on the model's stream now."""
        written = record_fence() if plan.save and self._cuda else None
        for job in plan.save:  # a request may have two: its prompt's and, finished, its output's
            self._saves[job.request_id] = self._saves.get(job.request_id, 0) + 1
            with self._lock:
                self._saving[job.request_id] = threading.Event()
            save = functools.partial(self._save, written=written)
            self._lanes.submit(_SAVES, self._guarded(_Kind.SAVE, save, job))

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
                if self._saves[rid]:
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
                self._saved.extend(outcome.saved)
                rid = outcome.request_id
                if rid in self._saves:
                    self._saves[rid] -= 1
                    if not self._saves[rid]:
                        self._release(rid, _Hold.SAVE)
                continue
            recving.add(outcome.request_id)
            self._reading -= 1  # a read's or a load's (saves went on above)
            if outcome.trace is not None:
                self._collected(outcome, outcome.trace)
            if not outcome.ok:
                failed.add(outcome.request_id)
                # Block ids are per KV-cache group: vLLM takes failed blocks of one group only
                # (with several it fails on them; the failed request says it all).
                if len(set(self._layer_groups.values())) <= 1:
                    self._load_errors.update(outcome.failed_blocks)
        sending = {rid for rid, waits in self._holds.items() if not waits}
        for rid in sending:
            del self._holds[rid]
            self._saves.pop(rid, None)
        return sending, recving, failed

    def take_saved(self) -> list[str]:
        """Blocks (hashes) this rank saved whole, reported by :meth:`results` since the last
        call (the model-runner thread, after ``results``)."""
        saved, self._saved = self._saved, []
        return saved

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
            if outcome.ok:
                self.stats.observe(
                    pd_load_duration_seconds=outcome.seconds, pd_load_bytes=outcome.nbytes
                )
        elif outcome.kind is _Kind.LOAD:
            self.stats.add(
                pool_loads=1,
                pool_failed=0 if outcome.ok else 1,
                pool_bytes_loaded=outcome.nbytes,
                pool_load_seconds=outcome.seconds,
            )
            if outcome.ok:
                self.stats.observe(
                    pool_load_duration_seconds=outcome.seconds, pool_load_bytes=outcome.nbytes
                )
        else:
            self.stats.add(
                pool_saves=1,
                pool_save_failed=0 if outcome.ok else 1,
                pool_bytes_saved=outcome.nbytes,
            )
            self.stats.observe(
                pool_save_duration_seconds=outcome.seconds, pool_save_bytes=outcome.nbytes
            )

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
            self._report(_Outcome(item.request_id, kind, False, _real(blocks)))

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
            ranks, direct = self._peer_layout(remote.endpoint, remote.engine_id, remote.tp_size)
        except KVConnectError as exc:
            refused = isinstance(exc, IncompatiblePeer)  # logged once per prefill engine
            if not refused:
                log.error("cannot read KV of %s from %s: %s", job.request_id, remote.endpoint, exc)
            seconds = time.monotonic() - started
            outcome = _Outcome(
                job.request_id,
                _Kind.RECV,
                False,
                _real(job.local_blocks),
                0,
                seconds,
                refused=refused,
            )
            outcome.trace = trace
            self._report(outcome)
            if not isinstance(exc, PeerReplaced):  # else its blocks went with the old engine
                self._give_up(remote.endpoint, remote.request_id)
            return
        trace.stamp(Phase.LAYOUT)
        requests = self._read_requests(mine, ranks, direct, job)
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
        failed = () if ok else _real(job.local_blocks)
        moved = nbytes if ok else 0
        # Reported before telling prefill, so a dead prefill delays no recompute.
        outcome = _Outcome(
            job.request_id, _Kind.RECV, ok, failed, moved, seconds, io_seconds, trace=trace
        )
        unsettled = TransferStatus.PENDING in statuses
        self._report_settled(outcome, unsettled, batch.add_settled_callback)
        if not read:  # the prefill may be gone: ask its endpoint who serves it next time
            self.peers.read_failed(remote.endpoint, remote.engine_id)
            errors = [e for e in batch.errors if e is not None]
            problem = errors[0] if errors else statuses
            segments = sorted({r.segment for r in requests})
            log.error("reading KV of %s from %s failed: %s", job.request_id, segments, problem)
            self._give_up(remote.endpoint, remote.request_id)

    def _read_requests(
        self, mine: RankLayout, ranks: Mapping[int, RankLayout], direct: bool, job: RecvJob
    ) -> list[TransferRequest]:
        """The ranges of ``job``: block for block from the prefill rank of this rank's TP
        rank (``direct``: its blocks are this rank's byte for byte), else each head this rank
        holds, token by token, from a prefill rank holding it (:mod:`.tpmap`). Each layer
        reads its KV-cache group's blocks."""
        rank = self.format.tp_rank
        requests: list[TransferRequest] = []
        if direct:
            theirs = ranks[rank]
            for local, remote in zip(mine.layers, theirs.layers, strict=True):
                region = self._regions[local.region]
                local_blocks = job.local_blocks[local.group]
                remote_blocks = job.remote_blocks[remote.group]
                for lo, ro, length in range_pairs(local, remote, local_blocks, remote_blocks):
                    requests.append(
                        TransferRequest(region, lo, theirs.segment, remote.region, ro, length)
                    )
            return requests
        for i, local in enumerate(mine.layers):
            region = self._regions[local.region]
            layers = {r: layout.layers[i] for r, layout in ranks.items()}
            local_blocks, remote_blocks, first = self._mapped_blocks(ranks[0], local.group, job)
            for span in layer_spans(local, layers, local_blocks, remote_blocks, first, rank):
                segment, remote_region = ranks[span.rank].segment, layers[span.rank].region
                requests.append(
                    TransferRequest(
                        region, span.local, segment, remote_region, span.remote, span.length
                    )
                )
        return requests

    def _mapped_blocks(
        self, theirs: RankLayout, group: int, job: RecvJob
    ) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """``(local blocks, remote blocks, first token of the local ones)`` of one KV-cache
        group for :func:`~kvconnect.vllm.tpmap.layer_spans`, whose remote blocks start at
        the prompt's first token: with equal block sizes the job's pairs (both start at the
        same position, so at token 0 of their own), else every block prefill holds (one
        group only: :meth:`_peer_layout` refuses the others)."""
        if theirs.format.block_size == self.format.block_size:
            return job.local_blocks[group], job.remote_blocks[group], 0
        return job.local_blocks[group], job.remote.block_ids[group], job.first_token

    def _peer_layout(
        self, endpoint: str, engine_id: str, tp_size: int
    ) -> tuple[Mapping[int, RankLayout], bool]:
        """The prefill engine's ranks (their layouts cached by :attr:`peers`) and whether this
        rank reads its blocks directly (True) or mapped by heads and tokens (:mod:`.tpmap`).
        Raises IncompatiblePeer when that engine's KV cannot be read here: decided and logged
        once per engine, at first contact; PeerReplaced when another engine serves the
        endpoint now."""
        ranks, here = self.peers.get(endpoint, engine_id).ranks, self.format.tp_size
        mine = self.layout
        assert mine is not None
        if tp_size != len(ranks) or 0 not in ranks:
            raise self._refusal(
                endpoint, engine_id, f"tp_size: {tp_size} at the peer but {len(ranks)} ranks"
            )
        problem = f"tp_size: {tp_size} at the peer, {here} here"
        if tp_size == here:
            problem = check_compatible(mine, ranks[self.format.tp_rank]) or ""
            if not problem:
                return ranks, True
        unmappable = check_mappable(mine, ranks, strict=self.config.enforce_compat)
        groups = len({layer.group for layer in mine.layers})
        if (
            unmappable is None
            and groups > 1
            and ranks[0].format.block_size != self.format.block_size
        ):
            unmappable = f"block sizes differ with {groups} KV-cache groups"
        if unmappable is None:
            self._note_mapped(engine_id, problem)
            return ranks, False
        if tp_size == here and not self.config.enforce_compat:
            return ranks, True
        raise self._refusal(
            endpoint, engine_id, f"{problem}; not readable by heads and tokens: {unmappable}"
        )

    def _note_mapped(self, engine_id: str, difference: str) -> None:
        with self._lock:
            first = engine_id not in self._mapped
            self._mapped.add(engine_id)
        if first:
            log.info(
                "prefill engine %s differs (%s): reading each KV head from a prefill rank "
                "that holds it, token by token",
                engine_id,
                difference,
            )

    def _forget_peer(self, reply: msg.LayoutReply) -> None:
        """A prefill engine is gone for good (replaced or aged out of :attr:`peers`): drop the
        transfer engine's state for its segments, unless a cached engine still names them
        (a replacement listening where the old one did: the transfer engine notices that
        change on its own)."""
        gone = {rank.segment for rank in reply.ranks.values()} - self.peers.segments()
        for segment in gone:
            self.engine.forget_segment(segment)
        with self._lock:
            self._mapped.discard(reply.engine_id)

    def _refusal(self, endpoint: str, engine_id: str, problem: str) -> IncompatiblePeer:
        """The refusal to raise for ``engine_id`` (remembered with its layouts, logged at the
        first one)."""
        refusal = f"prefill engine {engine_id} has an incompatible KV format ({problem})"
        if self.peers.refuse(endpoint, engine_id, refusal):
            log.error(
                "%s: reading none of its KV; its requests are recomputed (or fail, per "
                "kv_load_failure_policy)",
                refusal,
            )
        return IncompatiblePeer(refusal)

    def _confirm(self, endpoint: str, remote_id: str, rid: str) -> bool:
        try:
            confirm = msg.Confirm(remote_id, self.format.tp_rank, self.format.tp_size)
            reply = self._client.call(endpoint, confirm)
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

    def _pool_objects(
        self, job: PoolJob
    ) -> tuple[list[str], list[list[Span]], list[BlockPart], list[int], list[int]]:
        """The store objects of ``job`` (one per block and KV-cache group that moves it) and
        for each: its key, this rank's ranges of it in the object's order (layer by layer,
        chunk by chunk), this rank's part of it, the block, and its position in ``job``."""
        assert self._pool_keys is not None
        keys: list[str] = []
        spans: list[list[Span]] = []
        parts: list[BlockPart] = []
        blocks: list[int] = []
        positions: list[int] = []
        for position, block_hash in enumerate(job.hashes):
            for group, (layers, part) in self._group_parts.items():
                block = job.blocks[group][position]
                if block == NULL_BLOCK:  # this group moves nothing at this position
                    continue
                keys.append(self._pool_keys.block_key(block_hash, group))
                spans.append(block_spans(layers, self._regions, block))
                parts.append(part)
                blocks.append(block)
                positions.append(position)
        return keys, spans, parts, blocks, positions

    def _load(self, job: PoolJob) -> None:
        assert self._store is not None
        started = time.monotonic()
        keys, spans, parts, blocks, _ = self._pool_objects(job)
        result = self._store.batch_get_scattered(
            keys,
            spans,
            object_offsets=[part.object_offset for part in parts],
            timeout=self.config.pool_read_timeout,
        )
        failed = tuple(block for block, ok in zip(blocks, result.ok(), strict=True) if not ok)
        seconds = time.monotonic() - started
        outcome = _Outcome(
            job.request_id, _Kind.LOAD, not failed, failed, sum(result.sizes), seconds
        )
        self._report_settled(outcome, Code.UNSETTLED in result.codes, result.on_settled)

    def _save(self, job: PoolJob, written: Fence | None = None) -> None:
        """Save ``job``'s blocks once ``written`` (the forward pass that wrote them) is done."""
        assert self._store is not None
        if written is not None:
            written.synchronize()
        started = time.monotonic()
        keys, spans, parts, _, positions = self._pool_objects(job)
        rank = self.format.tp_rank
        result = self._store.batch_put_gathered(
            keys,
            spans,
            part=rank,
            parts=self.format.tp_size,
            object_sizes=[part.object_bytes for part in parts],
            object_offsets=[part.object_offset for part in parts],
            timeout=self.config.pool_write_timeout,
        )
        ok = result.ok()
        failed = {p for p, stored in zip(positions, ok, strict=True) if not stored}
        saved = tuple(h for p, h in enumerate(job.hashes) if p not in failed and p in positions)
        seconds = time.monotonic() - started
        outcome = _Outcome(
            job.request_id, _Kind.SAVE, all(ok), (), sum(result.sizes), seconds, saved=saved
        )
        self._report_settled(outcome, Code.UNSETTLED in result.codes, result.on_settled)


def _real(blocks: GroupBlocks) -> tuple[int, ...]:
    """The blocks of every group, without vLLM's null placeholders (what a failed transfer
    reports to vLLM as load errors)."""
    return tuple(b for group in blocks for b in group if b != NULL_BLOCK)
