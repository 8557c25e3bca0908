"""The connector's scheduler side: which tokens come from elsewhere, and what the workers do
each step. Pure decisions (no torch, no vLLM imports); the services it is given do the I/O.

Runs in vLLM's engine-core process, on the scheduler thread. vLLM objects come in duck-typed
(:class:`RequestView`); block ids come in as plain lists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from kvconnect.vllm.params import prefill_params, remote_prefill, wants_remote_decode
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
    """Which prefix blocks the shared pool holds."""

    def leading(self, hashes: Sequence[str]) -> int:
        """How many of ``hashes``, from the first, are stored (0 when the pool is down)."""


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
    ) -> None:
        self._engine_id = engine_id
        self._host = host
        self._tp_size = tp_size
        self._block_size = block_size
        self._prefill = prefill
        self._keeper = keeper
        self._pool = pool
        self._requests: dict[str, RequestView] = {}
        self._pool_hits: dict[str, _PoolHit] = {}  # by request
        self._pooled: dict[str, int] = {}  # request → leading blocks known to be in the pool
        self._saving: set[str] = set()  # requests with a save planned (their frees wait)
        self._recv: list[RecvJob] = []
        self._load: list[PoolJob] = []
        self._held: list[str] = []

    # ------------------------------------------------------------------------- lookups

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
            total = request.num_prompt_tokens
            log.debug(
                "%s: %d tokens computed here, prefill %s has %s",
                request.request_id,
                num_computed,
                remote.engine_id,
                remote.num_tokens,
            )
            if remote.num_tokens is not None:
                total = min(total, remote.num_tokens)
            return _async(total - num_computed)
        if self._pool is None:
            return 0, False
        hit = self._pool_hits.get(request.request_id)
        if hit is None or hit.computed != num_computed:
            first = num_computed // self._block_size
            hashes = [h.hex() for h in request.block_hashes[first:]]
            hit = _PoolHit(num_computed, self._pool.leading(hashes) if hashes else 0)
            self._pool_hits[request.request_id] = hit
        return _async(hit.blocks * self._block_size)

    def after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external: int
    ) -> None:
        """vLLM's ``update_state_after_alloc``: ``block_ids`` are the request's new blocks."""
        rid = request.request_id
        params = request.kv_transfer_params
        remote = remote_prefill(params)
        if remote is not None and params is not None and self._keeper is not None:
            params["do_remote_prefill"] = False  # one transfer per request, even if preempted
            count = min(len(block_ids), len(remote.block_ids))
            if num_external > 0 and count > 0:
                self._recv.append(
                    RecvJob(
                        rid,
                        remote,
                        tuple(block_ids[:count]),
                        remote.block_ids[len(remote.block_ids) - count :],
                    )
                )
            else:  # everything was here already: prefill may free its blocks now
                self._keeper.give_up(rid, remote)
            return
        hit = self._pool_hits.pop(rid, None)
        if hit is None or num_external <= 0:
            return
        first = hit.computed // self._block_size
        count = min(num_external // self._block_size, len(block_ids))
        hashes = tuple(h.hex() for h in request.block_hashes[first : first + count])
        self._load.append(PoolJob(rid, hashes, tuple(block_ids[:count])))
        self._pooled[rid] = first + count

    # -------------------------------------------------------------------------------- steps

    def build_plan(
        self,
        scheduled: Mapping[str, int],
        block_ids_of: Callable[[str], Sequence[int]],
        preempted: Iterable[str] = (),
    ) -> StepPlan:
        """The workers' jobs for the step about to run. ``scheduled``: tokens per request in
        this step (``num_computed_tokens`` is still the count before it); ``preempted``:
        requests whose blocks were taken back this step."""
        save = self._plan_saves(scheduled, block_ids_of) if self._pool is not None else ()
        plan = StepPlan(
            recv=tuple(self._recv),
            load=tuple(self._load),
            save=save,
            held=tuple(self._held),
            released=tuple(self._prefill.take_released()) if self._prefill else (),
            preempted=tuple(rid for rid in preempted if rid in self._saving),
        )
        self._recv, self._load, self._held = [], [], []
        return plan

    def _plan_saves(
        self, scheduled: Mapping[str, int], block_ids_of: Callable[[str], Sequence[int]]
    ) -> tuple[PoolJob, ...]:
        # A prompt's full blocks are saved once, after the step that completes its prefill.
        jobs: list[PoolJob] = []
        for rid, count in scheduled.items():
            request = self._requests.get(rid)
            if request is None or rid in self._saving:
                continue
            if request.num_computed_tokens + count < request.num_prompt_tokens:
                continue
            self._saving.add(rid)
            full = min(request.num_prompt_tokens // self._block_size, len(request.block_hashes))
            skip = self._pooled.get(rid, 0)
            blocks = block_ids_of(rid)
            if full > skip and len(blocks) >= full:
                hashes = tuple(h.hex() for h in request.block_hashes[skip:full])
                jobs.append(PoolJob(rid, hashes, tuple(blocks[skip:full])))
        return tuple(jobs)

    def on_transfers_done(self, finished_recving: Iterable[str]) -> None:
        """The workers report these requests' KV arrived (or failed)."""
        if self._keeper is not None:
            for rid in finished_recving:
                self._keeper.done(rid)

    def request_finished(
        self, request: RequestView, block_ids: Sequence[int], completed: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: whether the blocks stay allocated (the workers report
        when they may go), and kv_transfer_params for the response. ``completed``: the request
        finished normally (not aborted)."""
        rid = request.request_id
        self._requests.pop(rid, None)
        self._pool_hits.pop(rid, None)
        self._pooled.pop(rid, None)
        params = request.kv_transfer_params
        remote = remote_prefill(params)
        if remote is not None and self._keeper is not None:  # never got to load: free them
            self._keeper.give_up(rid, remote)
        delay = rid in self._saving
        self._saving.discard(rid)
        if not (self._prefill and wants_remote_decode(params) and completed and block_ids):
            return delay, None
        self._prefill.hold(rid, readers=self._tp_size)
        self._held.append(rid)
        return True, prefill_params(
            engine_id=self._engine_id,
            request_id=rid,
            host=self._host,
            port=self._prefill.port,
            block_ids=block_ids,
            tp_size=self._tp_size,
            num_tokens=request.num_prompt_tokens,
        )


def _async(tokens: int) -> tuple[int, bool]:
    return (tokens, True) if tokens > 0 else (0, False)
