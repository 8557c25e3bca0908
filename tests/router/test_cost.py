from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconnect.errors import ConfigError
from kvconnect.router.cost import CostModel, Estimate
from kvconnect.router.types import Candidate, Load, Request, Role

BS = 16


def candidate(
    name: str = "a",
    *,
    cached: int = 0,
    inflight: int = 0,
    inflight_tokens: int = 0,
    running: int = 0,
    waiting: int = 0,
    ours_in_load: int = 0,
) -> Candidate:
    load = Load(running, waiting)
    return Candidate(name, Role.PREFILL, load, inflight, inflight_tokens, cached, ours_in_load)


def request(prompt: int = 160, pool: int = 0) -> Request:
    return Request(blocks=tuple(range(prompt // BS)), prompt_tokens=prompt, pool_blocks=pool)


def test_the_ttft_counts_overhead_queue_uncached_compute_and_pool_loads() -> None:
    model = CostModel(prefill_tps=1000.0, pool_tps=10_000.0, prefill_overhead=0.01)
    # 3 blocks cached locally, the pool holds 7: 4 blocks loaded, 3 blocks + 6 tokens computed
    estimate = model.estimate(candidate(cached=3, inflight_tokens=100), request(166, pool=7), BS)
    assert estimate == Estimate(
        queue_tokens=100,
        compute_tokens=54,
        pool_tokens=64,
        tps=1000.0,
        pool_seconds=0.0064,
        overhead=0.01,
    )
    assert model.predict_ttft(
        candidate(cached=3, inflight_tokens=100), request(166, pool=7), BS
    ) == pytest.approx(0.01 + 0.154 + 0.0064)


def test_the_pool_adds_nothing_below_the_local_cache_and_the_last_token_is_computed() -> None:
    model = CostModel()
    estimate = model.estimate(candidate(cached=10), request(160, pool=4), BS)
    assert (estimate.compute_tokens, estimate.pool_tokens) == (1, 0)
    estimate = model.estimate(candidate(cached=2), request(160, pool=10), BS)
    assert (estimate.compute_tokens, estimate.pool_tokens) == (1, 127)
    estimate = model.estimate(candidate(cached=2), request(160, pool=5), BS)
    assert (estimate.compute_tokens, estimate.pool_tokens) == (80, 48)


def test_waiting_requests_the_router_did_not_send_count_as_long_as_this_prompt() -> None:
    model = CostModel()
    # 5 waiting on /metrics, 2 of them possibly the router's own at that scrape
    ours = candidate(inflight=2, inflight_tokens=50, waiting=5, ours_in_load=2)
    assert model.estimate(ours, request(), BS).queue_tokens == 50 + 3 * 160
    ours = candidate(inflight=7, inflight_tokens=50, waiting=5, ours_in_load=7)
    assert model.estimate(ours, request(), BS).queue_tokens == 50
    # the router's request the scrape caught waiting finished since: it is not someone else's
    finished = candidate(inflight=0, inflight_tokens=0, waiting=1, ours_in_load=1)
    assert model.estimate(finished, request(), BS).queue_tokens == 0


def test_prefill_throughput_starts_at_the_default_and_follows_observations() -> None:
    model = CostModel(prefill_tps=1000.0, prefill_overhead=0.0, alpha=0.5)
    assert model.tps("a") == 1000.0
    model.observe_prefill("a", 400, 0.1)  # the first sample replaces the default
    assert model.tps("a") == pytest.approx(4000.0)
    model.observe_prefill("a", 200, 0.1)
    assert model.tps("a") == pytest.approx(3000.0)
    model.observe_prefill("a", 100, 0.0)  # ignored
    model.observe_prefill("a", -1, 0.1)  # ignored
    assert model.tps("a") == pytest.approx(3000.0)
    assert model.predict_ttft(candidate("a"), request(3000), BS) == pytest.approx(1.0)
    # an instance not observed yet takes its observed peers' mean, not the prior
    assert model.tps("b") == pytest.approx(3000.0)
    model.observe_prefill("c", 100, 0.1)
    assert model.tps("b") == pytest.approx((3000.0 + 1000.0) / 2)
    assert CostModel(prefill_tps=1000.0).tps("b") == 1000.0


def test_short_prefills_calibrate_the_fixed_cost_and_pool_loads_the_pool_rate() -> None:
    model = CostModel(prefill_tps=1000.0, prefill_overhead=0.03, alpha=0.5)
    # a cache hit: 8 tokens computed (8 ms predicted) in a 60 ms call
    model.observe_prefill("hits", 8, 0.060)
    assert model.tps("hits") == 1000.0, "a cache hit made its instance look slow"
    assert model.overhead == pytest.approx(0.03 + 0.5 * (0.052 - 0.03))
    model.observe_prefill("hits", 0, 0.051)  # no work at all: the fixed cost alone
    assert model.overhead == pytest.approx(0.041 + 0.5 * (0.051 - 0.041))
    # a long prefill: 2000 tokens in 1.04 s with the fixed cost taken off
    before = model.overhead
    model.observe_prefill("cold", 2000, 1.0 + before)
    assert model.tps("cold") == pytest.approx(2000.0)
    assert model.overhead == before, "compute calibrated the fixed cost"
    # a prefill that loaded 1000 tokens from the pool: its time past overhead and compute
    overhead = model.overhead
    model.observe_prefill("cold", 200, overhead + 0.1 + 0.25, pool_tokens=1000)
    assert model.pool_tps == pytest.approx(1000 / 0.25)
    assert model.tps("cold") == pytest.approx(2000.0), "a pool load counted as compute"
    assert model.overhead == overhead
    # the fixed cost is the fleet's: it never decides between instances
    a, b = candidate("hits", cached=9), candidate("other", cached=9)
    assert model.predict_ttft(a, request(160), BS) == model.predict_ttft(b, request(160), BS)


def test_decode_load_is_running_plus_k_times_waiting_with_the_routers_unseen_requests() -> None:
    model = CostModel(k_waiting=0.5)
    assert model.decode_load(candidate(running=4, waiting=2, inflight=3)) == 5.0
    # the router sent 10, /metrics shows 3: the 7 it has not seen yet count as waiting
    assert model.decode_load(candidate(running=2, waiting=1, inflight=10)) == 2 + 0.5 * 8


def test_tbt_grows_with_the_decode_batch_and_is_calibrated_per_sequence() -> None:
    model = CostModel(decode_tbt=0.01, k_waiting=1.0, alpha=1.0)
    assert model.predict_tbt(candidate()) == pytest.approx(0.01)
    assert model.predict_tbt(candidate(running=3, waiting=1)) == pytest.approx(0.05)
    model.observe_decode("a", batch=4, tbt=0.08)
    assert model.per_seq("a") == pytest.approx(0.02)
    assert model.predict_tbt(candidate(running=3, waiting=1)) == pytest.approx(0.10)
    model.observe_decode("a", batch=0, tbt=0.08)  # ignored
    assert model.per_seq("a") == pytest.approx(0.02)


@given(
    cached=st.integers(0, 20),
    pool=st.integers(0, 20),
    inflight_tokens=st.integers(0, 10_000),
    waiting=st.integers(0, 20),
    prompt=st.integers(1, 400),
)
def test_more_cache_never_costs_more_and_more_queue_never_costs_less(
    cached: int, pool: int, inflight_tokens: int, waiting: int, prompt: int
) -> None:
    model = CostModel()  # the pool loads faster than the instance computes

    def ttft(cached: int, pool: int, inflight_tokens: int, waiting: int) -> float:
        c = candidate(cached=cached, inflight_tokens=inflight_tokens, waiting=waiting)
        return model.predict_ttft(c, request(prompt, pool), BS)

    base = ttft(cached, pool, inflight_tokens, waiting)
    assert base > 0
    assert ttft(cached + 1, pool, inflight_tokens, waiting) <= base
    assert ttft(cached, pool + 1, inflight_tokens, waiting) <= base
    assert ttft(cached, pool, inflight_tokens + 1, waiting) > base
    assert ttft(cached, pool, inflight_tokens, waiting + 1) > base


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prefill_tps": 0.0},
        {"pool_tps": -1.0},
        {"decode_tbt": 0.0},
        {"k_waiting": -0.1},
        {"alpha": 0.0},
        {"alpha": 1.5},
        {"prefill_tps": float("nan")},
    ],
)
def test_invalid_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        CostModel(**kwargs)
