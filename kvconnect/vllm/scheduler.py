"""The connector's scheduler side: which tokens come from elsewhere, and what the workers do
each step. Pure decisions (no torch, no vLLM imports); the services it is given do the I/O.

Runs in vLLM's engine-core process, on the scheduler thread. vLLM objects come in duck-typed
(:class:`RequestView`); block ids come in as plain lists, one per KV-cache group
(:mod:`kvconnect.vllm.groups`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from kvconnect.vllm.groups import (
    FULL_ONLY,
    Group,
    GroupKind,
    pair_tails,
    pool_blocks,
    transferable,
)
from kvconnect.vllm.params import (
    RemotePrefill,
    prefill_params,
    remote_prefill,
    wants_remote_decode,
)
from kvconnect.vllm.pd import LeaseKeeper, PrefillService
from kvconnect.vllm.plan import PoolJob, RecvJob, StepPlan

log = logging.getLogger(__name__)


class RequestView(Protocol):
    """The parts of vLLM's ``Request`` the scheduler side reads."""

    @property
    def request_id(self) -> str: ...
    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def block_hashes(self) -> Sequence[bytes]: ...


class PoolIndex(Protocol):
    """Which prefix blocks the shared pool holds (:class:`~kvconnect.vllm.lookup.PoolLookups`)."""

    def ask(self, request_id: str, first: int, hashes: Sequence[str]) -> int | None:
        """How many of ``hashes`` (blocks ``first, first+1, …`` of the request's prompt), from
        the first, the pool holds usably for every KV-cache group (0 when the pool is down);
        None while that is being looked up. Never blocks."""

    def forget(self, request_id: str) -> None:
        """Drop what is known of ``request_id``."""

    @property
    def usable(self) -> bool:
        """Whether blocks may be saved."""


class _PoolHit(NamedTuple):
    """What the pool holds of a request, as last looked up."""

    computed: int  # tokens computed locally when it was looked up
    blocks: int  # leading blocks after those that the pool holds


class ConnectorScheduler:
    """Scheduler-side state of one engine (prefill, decode, pool, or several at once)."""

    def __init__(
        self,
        *,
        engine_id: str,
        host: str,
        tp_size: int,
        block_size: int,
        prefill: PrefillService | None = None,
        keeper: LeaseKeeper | None = None,
        pool: PoolIndex | None = None,
        groups: Sequence[Group] = FULL_ONLY,
        save_generated: bool = False,
    ) -> None:
        """``save_generated``: also save a finished request's full output blocks."""
        self._engine_id = engine_id
        self._host = host
        self._tp_size = tp_size
        self._block_size = block_size
        self._prefill = prefill
        self._keeper = keeper
        self._groups = tuple(groups)
        # The pool keeps no Mamba states: a model with a state group computes its prefixes.
        self._pool = pool if all(g.kind is not GroupKind.STATE for g in groups) else None
        if pool is not None and self._pool is None:
            log.warning("the shared pool keeps no Mamba states: pool off for this model")
        self._save_generated = save_generated
        self._requests: dict[str, RequestView] = {}
        self._pool_hits: dict[str, _PoolHit] = {}  # by request
        self._pooled: dict[str, int] = {}  # request → leading blocks known to be in the pool
        self._saving: set[str] = set()  # requests with a save planned (their frees wait)
        self._window_saves: set[str] = set()  # saves planned last step that read window blocks
        self._saved: dict[str, int] = {}  # request → leading blocks saved (or already pooled)
        self._finished_saves: list[PoolJob] = []  # saves of finished requests' output blocks
        self._recv: list[RecvJob] = []
        self._load: list[PoolJob] = []
        self._held: list[str] = []

    # ------------------------------------------------------------------------- lookups

    def prefill_backoff(self, request: RequestView) -> int:
        """Trailing prompt tokens prefill must leave for decode to compute: 1 for a model
        with a state (Mamba) group, whose state after the whole prompt decode could not
        step back from (decode recomputes the last prompt token, as for attention, and needs
        the state before it); 0 otherwise."""
        state = any(g.kind is GroupKind.STATE for g in self._groups)
        wanted = self._prefill is not None and wants_remote_decode(request.kv_transfer_params)
        return 1 if state and wanted and request.num_prompt_tokens > 1 else 0

    def request(self, request_id: str) -> RequestView | None:
        """The unfinished request ``request_id`` (None once finished, or unknown)."""
        return self._requests.get(request_id)

    def on_new_request(self, request: RequestView) -> None:
        self._requests[request.request_id] = request
        remote = remote_prefill(request.kv_transfer_params)
        if remote is not None and self._keeper is not None:
            self._keeper.track(request.request_id, remote)

    def matched_tokens(self, request: RequestView, num_computed: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: tokens beyond the local prefix hit that can
        be loaded, always asynchronously (between steps)."""
        remote = remote_prefill(request.kv_transfer_params)
        if remote is not None:
            if self._keeper is None:
                log.warning(
                    "request %s wants a remote prefill, but this engine is not a KV "
                    "consumer: computing it locally",
                    request.request_id,
                )
                return 0, False
            total = _remote_total(request, remote)
            log.debug(
                "%s: %d tokens computed here, prefill %s has %s",
                request.request_id,
                num_computed,
                remote.engine_id,
                remote.num_tokens,
            )
            if len(remote.block_ids) != len(self._groups):
                log.error(
                    "%s: prefill has %d KV-cache groups, this engine %d: computing locally",
                    request.request_id, len(remote.block_ids), len(self._groups),
                )  # fmt: skip
                return 0, False
            return _async(total - num_computed)
        if self._pool is None:
            return 0, False
        hit = self._pool_hits.get(request.request_id)
        if hit is None or hit.computed != num_computed:
            first = num_computed // self._block_size
            hashes = [h.hex() for h in request.block_hashes[first:]]
            blocks = self._pool.ask(request.request_id, first, hashes) if hashes else 0
            if blocks is None:  # vLLM skips the request this step and asks again
                return None, False
            hit = _PoolHit(num_computed, blocks)
            self._pool_hits[request.request_id] = hit
        return _async(hit.blocks * self._block_size)

    def loaded_groups(self, request: RequestView) -> tuple[int, ...]:
        """vLLM's ``get_loaded_kv_cache_group_ids``: the groups whose blocks a load of
        ``request`` fills (every group: PD moves each, a pool hit covers each)."""
        return tuple(range(len(self._groups)))

    def after_alloc(
        self,
        request: RequestView,
        block_ids: Sequence[Sequence[int]],
        all_block_ids: Callable[[], Sequence[Sequence[int]]],
        num_external: int,
    ) -> None:
        """vLLM's ``update_state_after_alloc``: ``block_ids`` are the request's new blocks per
        group, ``all_block_ids`` gives all its blocks per group, position by position."""
        rid = request.request_id
        params = request.kv_transfer_params
        remote = remote_prefill(params)
        if remote is not None and params is not None and self._keeper is not None:
            params["do_remote_prefill"] = False  # one transfer per request, even if preempted
            job = self._recv_job(request, remote, block_ids, num_external)
            if job is not None:
                self._recv.append(job)
            else:  # everything was here already: prefill may free its blocks now
                self._keeper.give_up(rid, remote)
            return
        hit = self._pool_hits.pop(rid, None)
        if self._pool is not None:
            self._pool.forget(rid)
        if hit is None or num_external <= 0:
            return
        first = hit.computed // self._block_size
        end = min(first + num_external // self._block_size, len(request.block_hashes))
        hashes = tuple(h.hex() for h in request.block_hashes[first:end])
        blocks = pool_blocks(self._groups, all_block_ids(), first, end, self._block_size)
        self._load.append(PoolJob(rid, hashes, blocks))
        self._pooled[rid] = max(end, first + hit.blocks)  # the pool has them: no save

    def _recv_job(
        self,
        request: RequestView,
        remote: RemotePrefill,
        block_ids: Sequence[Sequence[int]],
        num_external: int,
    ) -> RecvJob | None:
        """Decode's read of prefill's blocks into ``block_ids`` (the new ones per group), or
        None when nothing is to be read (``matched_tokens`` refused prefill's groups)."""
        if num_external <= 0 or len(remote.block_ids) != len(self._groups):
            return None
        local = transferable(self._groups, block_ids)
        # A full group loads only the positions after decode's own prefix hit.
        counts = [
            len(ids)
            if g.kind is not GroupKind.FULL
            else min(len(ids), -(-num_external // self._block_size))
            for g, ids in zip(self._groups, local, strict=True)
        ]
        mine, theirs = pair_tails(local, remote.block_ids, counts)
        # The new blocks start after the tokens decode had (matched_tokens' total).
        first = _remote_total(request, remote) - num_external
        return RecvJob(request.request_id, remote, mine, theirs, first_token=first)

    # -------------------------------------------------------------------------------- steps

    def build_plan(
        self,
        scheduled: Mapping[str, int],
        block_ids_of: Callable[[str], Sequence[Sequence[int]]],
        preempted: Iterable[str] = (),
    ) -> StepPlan:
        """The workers' jobs for the step about to run. ``scheduled``: tokens per request in
        this step (``num_computed_tokens`` is still the count before it); ``block_ids_of``:
        a request's blocks per group, position by position; ``preempted``: requests whose
        blocks were taken back this step."""
        pool = self._pool
        save: tuple[PoolJob, ...] = ()
        if pool is not None and pool.usable:
            save = (*self._plan_saves(scheduled, block_ids_of), *self._finished_saves)
        self._finished_saves = []
        # vLLM frees the blocks a window left behind while the request runs (not through
        # request_finished): a save begun last step may still read them.
        protected = {*preempted, *self._window_saves} & self._saving
        plan = StepPlan(
            recv=tuple(self._recv),
            load=tuple(self._load),
            save=save,
            held=tuple(self._held),
            released=tuple(self._prefill.take_released()) if self._prefill else (),
            preempted=tuple(sorted(protected)),
        )
        self._recv, self._load, self._held = [], [], []
        sliding = [i for i, g in enumerate(self._groups) if g.kind is GroupKind.SLIDING]
        self._window_saves = {
            job.request_id for job in save if any(any(job.blocks[i]) for i in sliding)
        }
        return plan

    def _plan_saves(
        self,
        scheduled: Mapping[str, int],
        block_ids_of: Callable[[str], Sequence[Sequence[int]]],
    ) -> tuple[PoolJob, ...]:
        # A prompt's full blocks are saved once, after the step that completes its prefill;
        # only a request with a save planned has its frees wait (a full pool hit has none).
        jobs: list[PoolJob] = []
        for rid, count in scheduled.items():
            request = self._requests.get(rid)
            if request is None or rid in self._saved:
                continue
            if request.num_computed_tokens + count < request.num_prompt_tokens:
                continue
            full = min(request.num_prompt_tokens // self._block_size, len(request.block_hashes))
            skip = self._pooled.get(rid, 0)
            ids = block_ids_of(rid)
            self._saved[rid] = max(full, skip)
            if full > skip and len(ids) == len(self._groups):
                self._saving.add(rid)
                hashes = tuple(h.hex() for h in request.block_hashes[skip:full])
                blocks = pool_blocks(self._groups, ids, skip, full, self._block_size)
                jobs.append(PoolJob(rid, hashes, blocks))
        return tuple(jobs)

    def _save_output(
        self, request: RequestView, block_ids: Sequence[Sequence[int]], saved: int
    ) -> None:
        """Plan the save of ``request``'s full blocks (per group, position by position) past
        the ``saved`` leading ones whose KV was computed (the last sampled token has none
        yet); its blocks wait for it."""
        computed = request.num_computed_tokens // self._block_size
        positions = min((len(ids) for ids in block_ids), default=0)
        full = min(computed, len(request.block_hashes), positions)
        if full <= saved or len(block_ids) != len(self._groups):
            return
        hashes = tuple(h.hex() for h in request.block_hashes[saved:full])
        blocks = pool_blocks(self._groups, block_ids, saved, full, self._block_size)
        self._finished_saves.append(PoolJob(request.request_id, hashes, blocks))
        self._saving.add(request.request_id)

    def on_transfers_done(self, finished_recving: Iterable[str]) -> None:
        """The workers report these requests' KV arrived (or failed)."""
        if self._keeper is not None:
            for rid in finished_recving:
                self._keeper.done(rid)

    def request_finished(
        self, request: RequestView, block_ids: Sequence[Sequence[int]], completed: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished_all_groups``: whether the blocks stay allocated (the
        workers report when they may go), and kv_transfer_params for the response.
        ``block_ids``: per group (vLLM has freed what sliding windows left behind);
        ``completed``: the request finished normally (not aborted)."""
        rid = request.request_id
        self._requests.pop(rid, None)
        self._pool_hits.pop(rid, None)
        self._pooled.pop(rid, None)
        if self._pool is not None:
            self._pool.forget(rid)
        params = request.kv_transfer_params
        remote = remote_prefill(params)
        if remote is not None and self._keeper is not None:  # never got to load: free them
            self._keeper.give_up(rid, remote)
        saved = self._saved.pop(rid, None)
        if completed and saved is not None and self._save_generated:
            self._save_output(request, block_ids, saved)
        delay = rid in self._saving
        self._saving.discard(rid)
        held = transferable(self._groups, block_ids)
        if not (self._prefill and wants_remote_decode(params) and completed and any(held)):
            return delay, None
        self._prefill.hold(rid)
        self._held.append(rid)
        return True, prefill_params(
            engine_id=self._engine_id,
            request_id=rid,
            host=self._host,
            port=self._prefill.port,
            block_ids=held,
            tp_size=self._tp_size,
            num_tokens=request.num_prompt_tokens,
        )


def _remote_total(request: RequestView, remote: RemotePrefill) -> int:
    """The prompt tokens prefill's blocks hold."""
    if remote.num_tokens is None:
        return request.num_prompt_tokens
    return min(request.num_prompt_tokens, remote.num_tokens)


def _async(tokens: int) -> tuple[int, bool]:
    return (tokens, True) if tokens > 0 else (0, False)
