"""Routing policies: which prefill and which decode instance serve a request, and admission.

Pure. A policy sees the request and the healthy candidates of the role being chosen (prefill or
unified instances for :meth:`Policy.prefill`, decode instances for :meth:`Policy.decode`) and
raises ``BrokenError`` when there is none.

- :class:`CacheAware` (``--policy cache``): prefill on the candidate of least predicted TTFT
  (:mod:`.cost`); predictions within :func:`margin` of the least count as ties, which go to
  the one holding more of the prompt, then the lower prediction, fewer in flight, then name;
  decode on the least decode load (``running + k * waiting``), ties the same way.
- :class:`RoundRobin` (``--policy round-robin``): each role in turn, as the example proxy does.
- :class:`Random` (``--policy random``): uniformly, from a seeded generator.

:func:`admit` turns a prediction into an early rejection when it would break an SLO.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from kvconnect.errors import BrokenError
from kvconnect.router.cost import CostModel
from kvconnect.router.types import Breach, Candidate, Choice, Rejection, Request, Role, Slo

TBT_RETRY_AFTER = 1.0
"""Retry-After of a TBT rejection (seconds): a decode batch shrinks as its sequences finish,
which the router cannot predict without their output lengths."""


class Policy(Protocol):
    """Chooses an instance of each role for a request."""

    def prefill(self, r: Request, cs: Sequence[Candidate]) -> Choice: ...

    def decode(self, r: Request, cs: Sequence[Candidate]) -> Choice: ...


def _require(cs: Sequence[Candidate]) -> None:
    if not cs:
        raise BrokenError("no healthy instance to route to")


def _choice(c: Candidate, predicted_ttft: float = 0.0) -> Choice:
    return Choice(instance=c.name, predicted_ttft=predicted_ttft, cached_blocks=c.cached_blocks)


class CacheAware:
    """Prefill by predicted TTFT, decode by load, both from ``model``; ``block_size`` is the
    one the request's hash chain was computed with."""

    def __init__(self, model: CostModel, block_size: int) -> None:
        self.model = model
        self._block_size = block_size

    def prefill(self, r: Request, cs: Sequence[Candidate]) -> Choice:
        _require(cs)
        ttft = {c.name: self.model.predict_ttft(c, r, self._block_size) for c in cs}
        least = min(ttft.values())
        near = [c for c in cs if ttft[c.name] <= least + margin(least, self.model.overhead)]
        best = min(near, key=lambda c: (-c.cached_blocks, ttft[c.name], c.inflight, c.name))
        return _choice(best, ttft[best.name])

    def decode(self, r: Request, cs: Sequence[Candidate]) -> Choice:
        _require(cs)
        return _choice(min(cs, key=lambda c: (self.model.decode_load(c), c.inflight, c.name)))


def margin(least: float, overhead: float) -> float:
    """How much worse than the least predicted TTFT a prediction may be and still count as a
    tie: a tenth of it, or a request's fixed cost if more. Throughputs calibrated from short
    prefills differ between instances by more than a short prompt's compute, so without it a
    few noisy samples send a prefix's requests off the instance holding it, to load it from
    the pool elsewhere for nothing."""
    return max(0.1 * least, overhead)


class RoundRobin:
    """Each role's candidates in turn (by position in the sequence given)."""

    def __init__(self) -> None:
        self._next = {Role.PREFILL: 0, Role.DECODE: 0}

    def prefill(self, r: Request, cs: Sequence[Candidate]) -> Choice:
        return self._turn(Role.PREFILL, cs)

    def decode(self, r: Request, cs: Sequence[Candidate]) -> Choice:
        return self._turn(Role.DECODE, cs)

    def _turn(self, role: Role, cs: Sequence[Candidate]) -> Choice:
        _require(cs)
        turn = self._next[role]
        self._next[role] = turn + 1
        return _choice(cs[turn % len(cs)])


class Random:
    """Uniformly random candidates from a generator seeded with ``seed``."""

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def prefill(self, r: Request, cs: Sequence[Candidate]) -> Choice:
        _require(cs)
        return _choice(self._random.choice(cs))

    def decode(self, r: Request, cs: Sequence[Candidate]) -> Choice:
        _require(cs)
        return _choice(self._random.choice(cs))


def admit(choice_ttft: float, tbt: float | None, slo: Slo) -> Rejection | None:
    """None when the predicted TTFT (``choice_ttft``) and TBT (``tbt``, None when unknown) keep
    ``slo``; else the rejection. A TTFT breach is retried after its excess (the time the chosen
    instance's queue needs to drain by that much), a TBT breach after :data:`TBT_RETRY_AFTER`;
    when both break, the TTFT's reason with the longer wait."""
    ttft_excess = choice_ttft - slo.ttft if slo.ttft is not None else 0.0
    tbt_breaks = slo.tbt is not None and tbt is not None and tbt > slo.tbt
    if ttft_excess > 0:
        wait = max(ttft_excess, TBT_RETRY_AFTER) if tbt_breaks else ttft_excess
        return Rejection(Breach.TTFT, wait)
    if tbt_breaks:
        return Rejection(Breach.TBT, TBT_RETRY_AFTER)
    return None
