from __future__ import annotations

from dataclasses import replace

import pytest

from kvconnect.errors import BrokenError
from kvconnect.router.cost import CostModel
from kvconnect.router.policy import TBT_RETRY_AFTER, CacheAware, Random, RoundRobin, admit
from kvconnect.router.types import Breach, Candidate, Load, Rejection, Request, Role, Slo

BS = 16
PROMPT = 160  # 10 blocks
HOT = Request(blocks=tuple(range(10)), prompt_tokens=PROMPT, pool_blocks=0)


def idle(name: str, role: Role = Role.PREFILL, cached: int = 0) -> Candidate:
    return Candidate(
        name, role, Load(), inflight=0, inflight_tokens=0, cached_blocks=cached, ours_in_load=0
    )


def policy() -> CacheAware:
    return CacheAware(CostModel(prefill_tps=1000.0, pool_tps=10_000.0, prefill_overhead=0.0), BS)


@pytest.mark.parametrize(
    ("pool_blocks", "last_on_a"),
    [
        # B recomputes all 160 tokens (0.160 s); A computes the 32 it lacks: (q + 32) / 1000,
        # chosen while within the tie margin, a tenth over B's: up to q = 144
        (0, 144),
        # B loads 128 tokens from the pool (0.0128 s) and computes 32 (0.032 s): 0.0448 s,
        # which A's (q + 32) / 1000 passes by a tenth at q = 17.28
        (8, 17),
    ],
)
def test_a_hot_prefix_moves_to_the_second_instance_exactly_when_its_queue_costs_more(
    pool_blocks: int, last_on_a: int
) -> None:
    request = replace(HOT, pool_blocks=pool_blocks)
    b = idle("b")
    for queue in range(last_on_a - 3, last_on_a + 4):
        a = replace(idle("a", cached=8), inflight=1, inflight_tokens=queue)
        choice = policy().prefill(request, [b, a])
        assert choice.instance == ("a" if queue <= last_on_a else "b"), queue
        assert choice.cached_blocks == (8 if choice.instance == "a" else 0)


@pytest.mark.parametrize(
    ("pool_blocks", "expected"),
    [
        # B must recompute: A takes requests until its queue passes 128 tokens (4 requests
        # ahead), then B one, then A again (B's queue is as long as the whole prompt)
        (0, ["a", "a", "a", "a", "a", "b", "a"]),
        # B loads the prefix from the pool: A's 12.8-token lead is gone after one request
        (8, ["a", "b", "a", "b", "a", "b", "a"]),
    ],
)
def test_a_stream_of_hot_requests_spreads_once_the_holders_queue_builds(
    pool_blocks: int, expected: list[str]
) -> None:
    """A holds 8 of the prompt's 10 blocks; the router's in-flight count grows with every
    dispatch and nothing finishes."""
    chooser = policy()
    fleet = {"a": idle("a", cached=8), "b": idle("b")}
    request = replace(HOT, pool_blocks=pool_blocks)
    placed = []
    for _ in expected:
        choice = chooser.prefill(request, list(fleet.values()))
        placed.append(choice.instance)
        c = fleet[choice.instance]
        uncached = chooser.model.estimate(c, request, BS).compute_tokens
        fleet[c.name] = replace(
            c, inflight=c.inflight + 1, inflight_tokens=c.inflight_tokens + uncached
        )
    assert placed == expected


def test_cold_requests_alternate_between_idle_instances() -> None:
    chooser = policy()
    fleet = {name: idle(name) for name in ("a", "b", "c")}
    placed = []
    for _ in range(6):
        choice = chooser.prefill(HOT, list(fleet.values()))
        placed.append(choice.instance)
        c = fleet[choice.instance]
        fleet[c.name] = replace(c, inflight=c.inflight + 1, inflight_tokens=c.inflight_tokens + 160)
    assert placed == ["a", "b", "c", "a", "b", "c"]


def test_the_predicted_ttft_of_the_choice_is_the_models() -> None:
    chooser = policy()
    a = replace(idle("a", cached=8), inflight=1, inflight_tokens=500)
    choice = chooser.prefill(HOT, [a])
    assert choice.predicted_ttft == pytest.approx(chooser.model.predict_ttft(a, HOT, BS))
    assert choice.predicted_ttft == pytest.approx(0.532)


def test_decode_goes_to_the_least_loaded_counting_the_routers_unseen_requests() -> None:
    chooser = policy()
    busy = replace(idle("a", Role.DECODE), load=Load(running=4, waiting=0), inflight=4)
    queued = replace(idle("b", Role.DECODE), load=Load(running=1, waiting=2), inflight=3)
    assert chooser.decode(HOT, [busy, queued]).instance == "b"  # 1 + 2 < 4
    # b's scrape is stale: the router has sent it 6 more since
    queued = replace(queued, inflight=9)
    assert chooser.decode(HOT, [busy, queued]).instance == "a"


def test_round_robin_cycles_each_role_on_its_own() -> None:
    rr = RoundRobin()
    prefills = [idle(n) for n in "abc"]
    decodes = [idle(n, Role.DECODE) for n in "xy"]
    assert [rr.prefill(HOT, prefills).instance for _ in range(4)] == ["a", "b", "c", "a"]
    assert [rr.decode(HOT, decodes).instance for _ in range(3)] == ["x", "y", "x"]
    assert rr.prefill(HOT, prefills).instance == "b"
    assert rr.prefill(HOT, prefills).predicted_ttft == 0.0


def test_random_is_seeded_and_reaches_every_candidate() -> None:
    cs = [idle(n) for n in "abcd"]
    first = [Random(7).prefill(HOT, cs).instance for _ in range(3)]
    assert len(set(first)) == 1  # the same seed, the same first choice
    chooser = Random(7)
    picks = [chooser.prefill(HOT, cs).instance for _ in range(200)]
    assert set(picks) == set("abcd")
    again = Random(7)
    assert [again.prefill(HOT, cs).instance for _ in range(200)] == picks


@pytest.mark.parametrize("chooser", [policy(), RoundRobin(), Random(0)])
def test_no_candidate_is_a_broken_error(chooser: CacheAware | RoundRobin | Random) -> None:
    with pytest.raises(BrokenError):
        chooser.prefill(HOT, [])
    with pytest.raises(BrokenError):
        chooser.decode(HOT, [])


def test_admission_rejects_what_breaks_an_slo_and_retries_after_the_excess() -> None:
    assert admit(0.9, 0.04, Slo(ttft=1.0, tbt=0.05)) is None
    assert admit(2.5, 0.04, Slo(ttft=1.0, tbt=0.05)) == Rejection(Breach.TTFT, 1.5)
    assert admit(0.5, 0.06, Slo(ttft=1.0, tbt=0.05)) == Rejection(Breach.TBT, TBT_RETRY_AFTER)
    assert admit(1.2, 0.06, Slo(ttft=1.0, tbt=0.05)) == Rejection(Breach.TTFT, TBT_RETRY_AFTER)
    assert admit(9.0, 9.0, Slo()) is None
    assert admit(0.5, None, Slo(tbt=0.05)) is None
    assert admit(1.0, 0.05, Slo(ttft=1.0, tbt=0.05)) is None  # at the objective is within it


def test_a_growing_queue_is_rejected_once_the_best_prediction_breaks_the_slo() -> None:
    chooser = policy()
    slo = Slo(ttft=0.5)
    for queue, expected in ((400, None), (468, None), (600, 0.132)):
        a = replace(idle("a", cached=8), inflight=2, inflight_tokens=queue)
        b = replace(idle("b"), inflight=2, inflight_tokens=queue)
        choice = chooser.prefill(HOT, [a, b])
        rejection = admit(choice.predicted_ttft, None, slo)
        if expected is None:
            assert rejection is None, queue
        else:
            assert rejection is not None
            assert rejection.reason == "ttft"
            assert rejection.retry_after == pytest.approx(expected)


def test_throughput_noise_within_a_requests_fixed_cost_keeps_the_prefix_on_its_holder() -> None:
    model = CostModel(prefill_tps=4000.0, pool_tps=200_000.0, prefill_overhead=0.03, alpha=1.0)
    model.observe_prefill("a", 400, 0.23)  # a looks slow: 2000 tokens/s
    model.observe_prefill("b", 400, 0.08)  # b fast: 8000 tokens/s
    # 32 blocks of prefix held by a (and in the pool), 40 tokens of its own to compute
    request = Request(blocks=tuple(range(32)), prompt_tokens=32 * BS + 40, pool_blocks=32)
    a, b = idle("a", cached=32), idle("b")
    assert model.predict_ttft(b, request, BS) < model.predict_ttft(a, request, BS)
    assert CacheAware(model, BS).prefill(request, [b, a]).instance == "a"
    # a queue behind a that costs more than the margin moves the request to b
    busy = replace(a, inflight=1, inflight_tokens=400)
    assert CacheAware(model, BS).prefill(request, [b, busy]).instance == "b"
