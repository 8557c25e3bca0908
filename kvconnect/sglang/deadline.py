"""When a HiCache prefetch read must answer: SGLang's prefetch budget and kvconnect's deadline
derived from it. Pure: times are passed in (``time.monotonic`` seconds).

SGLang's ``timeout`` stop policy gives a prefetch ``base + pages * per_page`` seconds, counted
from the scheduler's first blocked admission poll of the request; when that passes, SGLang
keeps only the pages already acknowledged and throws away the batch in flight, pages that
arrived included. A read that answers first, with the pages that arrived, loses none of them:
so every batch of an operation must end by the operation's creation (never later than SGLang's
clock start for a first attempt) plus the budget — or by SGLang's running clock itself, when
it started earlier (a refetch keeps the request's first budget) — less a margin for the
acknowledgement to reach the scheduler.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol


class PrefetchPolicy(enum.StrEnum):
    """SGLang's ``--hicache-storage-prefetch-policy``: when a prefetch stops."""

    BEST_EFFORT = "best_effort"  # at the request's first admission poll
    WAIT_COMPLETE = "wait_complete"  # never early: SGLang waits for every batch
    TIMEOUT = "timeout"  # when the budget has passed


DEFAULT_BASE = 1.0
"""SGLang 0.5.23's ``prefetch_timeout_base`` default (seconds)."""
DEFAULT_PER_KI_TOKEN = 0.25
"""SGLang 0.5.23's ``prefetch_timeout_per_ki_token`` default (seconds per 1024 tokens)."""


@dataclass(frozen=True, slots=True)
class PrefetchBudget:
    """SGLang's stop policy and its budget for a prefetch of ``pages`` pages:
    ``base + pages * per_page`` seconds."""

    policy: PrefetchPolicy
    base: float
    per_page: float

    @classmethod
    def of(
        cls,
        policy: str = PrefetchPolicy.TIMEOUT,
        base: float = DEFAULT_BASE,
        per_ki_token: float = DEFAULT_PER_KI_TOKEN,
        *,
        page_size: int,
    ) -> PrefetchBudget:
        """From SGLang's settings (its defaults for those not given); ValueError for a policy
        SGLang does not have."""
        return cls(PrefetchPolicy(policy), float(base), page_size / 1024 * float(per_ki_token))

    def seconds(self, pages: int) -> float:
        """SGLang's budget for a prefetch of ``pages`` pages."""
        return self.base + pages * self.per_page


class PrefetchClock(Protocol):
    """Where SGLang keeps its prefetch settings and clocks (the plugin's view of the radix
    cache); called from the prefetch IO thread."""

    def budget(self) -> PrefetchBudget:
        """The policy and budget SGLang applies now."""

    def verdict(self, operation: Any) -> float | None:
        """When SGLang's ``timeout`` verdict on ``operation``'s request falls (monotonic
        time), if its clock runs already; None if it has not started."""


@dataclass(frozen=True, slots=True)
class Operation:
    """What a read knows of SGLang's prefetch operation it serves."""

    start: float
    """When SGLang created the operation (its ``start_time``)."""
    pages: int
    """Pages SGLang's budget counts for it (its requested tokens over the page size)."""
    verdict: float | None = None
    """When SGLang's running clock gives its verdict, if known (see :class:`PrefetchClock`)."""


def read_deadline(
    budget: PrefetchBudget,
    now: float,
    pages: int,
    *,
    operation: Operation | None,
    margin: float,
    cap: float | None,
) -> float:
    """The time by which one read of ``pages`` pages must answer, never before ``now``.

    * ``timeout`` policy, the operation known: its start plus its budget, or SGLang's verdict
      if that is known and earlier, less the margin (every batch of the operation shares this
      end).
    * ``timeout`` policy, the operation unknown (the plugin is not loaded): ``now`` plus the
      budget of this read's pages, less the margin — SGLang's clock started earlier, so this
      may still lose to its verdict.
    * Otherwise there is no SGLang deadline to beat (``wait_complete``, ``best_effort``, whose
      early stop arrives as a termination): ``now`` plus the budget of this read's pages, a
      bound of the same shape.

    The margin is at most a quarter of the budget, so a small budget still leaves most of it
    for the read. ``cap`` (``read_timeout``), if set, bounds the read from ``now``.
    """
    if budget.policy is not PrefetchPolicy.TIMEOUT:
        end = now + budget.seconds(pages)
    elif operation is not None:
        allowed = budget.seconds(operation.pages)
        end = operation.start + allowed
        if operation.verdict is not None:
            end = min(end, operation.verdict)
        end -= min(margin, allowed / 4)
    else:  # SGLang's clock started before this read: at least keep the margin
        allowed = budget.seconds(pages)
        end = now + allowed - min(margin, allowed / 4)
    if cap is not None:
        end = min(end, now + cap)
    return max(end, now)
