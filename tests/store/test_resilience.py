from __future__ import annotations

from kvconnect.store.resilience import BreakerState, CircuitBreaker, NegativeCache


def test_breaker_opens_after_consecutive_failures_and_probes_after_cooldown() -> None:
    breaker = CircuitBreaker(failures=3, cooldown=5.0)
    for t in range(2):
        assert breaker.allow(t)
        breaker.failure(t)
    breaker.success()  # a success resets the count
    for t in range(3):
        breaker.failure(10 + t)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allow(13.0)
    assert not breaker.allow(16.9)
    assert breaker.allow(17.0), "one probe after the cool-down"
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow(17.0), "only one probe at a time"
    breaker.failure(17.5)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allow(20.0)
    assert breaker.allow(22.5)
    breaker.success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow(22.6)
    assert breaker.trips == 2


def test_negative_cache_expires_and_is_bounded() -> None:
    cache = NegativeCache(ttl=10.0, limit=3)
    cache.add(["a", "b"], 0.0)
    assert cache.failing(["a", "b", "c"], 5.0) == [True, True, False]
    assert cache.failing(["a"], 10.0) == [False]
    cache.add(["c", "d", "e", "f"], 11.0)
    assert cache.failing(["b", "c", "d", "e", "f"], 12.0) == [False, False, True, True, True]
    cache.discard(["e"])
    assert cache.failing(["e"], 12.0) == [False]
    disabled = NegativeCache(ttl=0.0, limit=3)
    disabled.add(["a"], 0.0)
    assert disabled.failing(["a"], 0.0) == [False]


def test_a_half_open_breaker_judges_its_probe_either_way() -> None:
    breaker = CircuitBreaker(failures=1, cooldown=1.0)
    breaker.failure(0.0)
    assert breaker.allow(1.0)  # the probe
    assert not breaker.allow(1.0)
    breaker.failure(1.1)  # judged: open again, a new probe after the cool-down
    assert breaker.allow(2.2)
    breaker.success()
    assert breaker.state is BreakerState.CLOSED
