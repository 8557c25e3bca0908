"""The router's HTTP front in-process, in front of real aiohttp servers standing in for vLLM
(tests/router/standin.py): the PD flow, streaming, failover and retries, SLO rejection,
hostile input. Every answer is checked against what the stand-ins compute, byte for byte.
The real vLLM end to end is tests/router/test_router_end_to_end.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvconnect.router.app import RouterService, make_runner, service_of
from kvconnect.router.config import EventSource, RouterConfig
from kvconnect.store.kvevents import BlockStored
from kvconnect.store.master.kvevents import KvEventPublisher
from tests.router.standin import MODEL, StandIn, completion_text, stream_bytes
from tests.support.waiting import await_for

pytestmark = pytest.mark.integration

QUIET = 3600.0  # a health interval no test waits for: only requests change the fleet


class Front:
    """A running router and a client session to it."""

    def __init__(self, url: str, service: RouterService, client: aiohttp.ClientSession) -> None:
        self.url = url
        self.service = service
        self.client = client

    async def post(self, path: str, body: Any, **kwargs: Any) -> tuple[int, bytes, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.client.post(self.url + path, data=data, **kwargs) as reply:
            return reply.status, await reply.read(), reply.headers

    async def get(self, path: str) -> tuple[int, bytes]:
        async with self.client.get(self.url + path) as reply:
            return reply.status, await reply.read()

    def metric(self, name: str, **labels: str) -> float:
        value = self.service.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@contextlib.asynccontextmanager
async def front(**settings: Any) -> AsyncIterator[Front]:
    settings.setdefault("health_interval", QUIET)
    settings.setdefault("policy", "round-robin")
    runner = make_runner(RouterConfig(**settings))
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with aiohttp.ClientSession() as client:
            yield Front(url, service_of(runner.app), client)
    finally:
        await runner.cleanup()


def run(scenario: Callable[..., Awaitable[None]], *names: str) -> None:
    """Run ``scenario(*stand_ins)`` with started stand-ins named ``names``, stopped after."""

    async def main() -> None:
        instances = [StandIn(name) for name in names]
        try:
            for instance in instances:
                await instance.start()
            await scenario(*instances)
        finally:
            for instance in instances:
                await instance.stop()

    asyncio.run(main())


def answer(prompt: str, served_by: str, prefilled_by: str | None = None) -> dict[str, Any]:
    return {
        "id": "c",
        "choices": [{"text": completion_text(prompt)}],
        "prefilled_by": prefilled_by,
        "served_by": served_by,
    }


def test_a_pd_request_goes_to_prefill_then_to_decode_with_prefills_params() -> None:
    async def scenario(p: StandIn, d: StandIn) -> None:
        async with front(prefill=(p.url,), decode=(d.url,)) as f:
            body = {"model": MODEL, "prompt": "hello router", "max_tokens": 7, "foo": [1, 2]}
            status, data, _ = await f.post(
                "/v1/completions", body, headers={"Authorization": "Bearer k"}
            )
            assert status == 200
            assert json.loads(data) == answer("hello router", "d", prefilled_by="p")
            [(_, prefill_body)] = p.received
            assert prefill_body["max_tokens"] == 1
            assert prefill_body["stream"] is False
            assert prefill_body["kv_transfer_params"]["do_remote_decode"] is True
            assert prefill_body["foo"] == [1, 2]  # unknown fields pass through
            [(_, decode_body)] = d.received
            assert decode_body == {
                **body,
                "kv_transfer_params": {"remote_engine_id": "p", "blocks": [1]},
            }
            assert p.headers[0]["Authorization"] == d.headers[0]["Authorization"] == "Bearer k"
            assert f.metric("kvconnect_router_ttft_observed_seconds_count") == 1
            assert (
                f.metric(
                    "kvconnect_router_requests_total", endpoint="/v1/completions", outcome="ok"
                )
                == 1
            )

    run(scenario, "p", "d")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("pd", [True, False], ids=["pd", "unified"])
def test_a_stream_is_relayed_byte_for_byte(path: str, pd: bool) -> None:
    prompt = "stream me, chunk by chunk"
    if path.endswith("chat/completions"):
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    else:
        body = {"model": MODEL, "prompt": prompt}
    body |= {"stream": True, "stream_options": {"include_usage": True}}

    async def scenario(a: StandIn, b: StandIn) -> None:
        fleet = {"prefill": (a.url,), "decode": (b.url,)} if pd else {"unified": (a.url,)}
        async with front(**fleet) as f:
            status, data, headers = await f.post(path, body)
            assert status == 200
            assert headers["Content-Type"].startswith("text/event-stream")
            extra = {"prefilled_by": "a" if pd else None, "served_by": "b" if pd else "a"}
            assert data == stream_bytes(completion_text(prompt), extra)
            if pd:
                assert "stream_options" not in a.received[0][1]
                assert b.received[0][1]["stream_options"] == {"include_usage": True}

    run(scenario, "a", "b")


def test_a_request_to_an_instance_refusing_connections_is_retried_and_the_instance_taken_out() -> (
    None
):
    async def scenario(a: StandIn, b: StandIn) -> None:
        async with front(unified=(a.url, b.url), policy="random") as f:
            await a.stop()
            prompts: list[list[int]] = []
            for n in range(40):  # until the policy picked the dead instance once
                prompts.append([n, 1, 2])  # token ids: no /tokenize call finds it dead first
                status, data, _ = await f.post("/v1/completions", {"prompt": prompts[-1]})
                assert status == 200
                assert json.loads(data) == answer(str(prompts[-1]), "b")
                if not f.service.fleet.get(a.url).healthy:
                    break
            assert [body["prompt"] for _, body in b.received] == prompts
            assert not f.service.fleet.get(a.url).healthy
            assert f.metric("kvconnect_router_retries_total", role="unified") == 1
            assert (
                f.metric("kvconnect_router_instance_healthy", instance=a.url, role="unified") == 0
            )

    run(scenario, "a", "b")


def test_a_tokenize_call_that_cannot_connect_takes_the_instance_out() -> None:
    async def scenario(a: StandIn, b: StandIn) -> None:
        async with front(unified=(a.url, b.url)) as f:
            await a.stop()  # the idle instance listed first: asked to tokenise
            status, data, _ = await f.post("/v1/completions", {"prompt": "tokenised by a"})
            assert (status, json.loads(data)) == (200, answer("tokenised by a", "b"))
            assert not f.service.fleet.get(a.url).healthy
            assert f.metric("kvconnect_router_retries_total", role="unified") == 0

    run(scenario, "a", "b")


def test_a_pd_hop_whose_connection_closes_before_an_answer_is_retried_on_another_instance() -> None:
    async def scenario(p1: StandIn, p2: StandIn, d1: StandIn, d2: StandIn) -> None:
        fleet = {"prefill": (p1.url, p2.url), "decode": (d1.url, d2.url)}
        async with front(**fleet, policy="random") as f:
            p1.drop = d1.drop = True
            for n in range(40):  # until the policy picked each dropping instance once
                status, data, _ = await f.post("/v1/completions", {"prompt": f"p{n}"})
                assert status == 200
                assert json.loads(data) == answer(f"p{n}", "d2", prefilled_by="p2")
                if p1.received and d1.received:
                    break
            assert len(p1.received) == len(d1.received) == 1  # tried once, then out
            assert not f.service.fleet.get(p1.url).healthy
            assert not f.service.fleet.get(d1.url).healthy
            assert f.metric("kvconnect_router_retries_total", role="prefill") == 1
            assert f.metric("kvconnect_router_retries_total", role="decode") == 1

    run(scenario, "p1", "p2", "d1", "d2")


def test_a_5xx_before_any_byte_is_retried_and_the_instance_stays_in() -> None:
    async def scenario(a: StandIn, b: StandIn) -> None:
        async with front(unified=(a.url, b.url), policy="random") as f:
            a.fail_status = 503
            for n in range(40):  # until the policy picked the failing instance once
                status, data, _ = await f.post("/v1/completions", {"prompt": f"x{n}"})
                assert (status, json.loads(data)) == (200, answer(f"x{n}", "b"))
                if a.received:
                    break
            assert f.service.fleet.get(a.url).healthy
            assert len(b.received) == n + 1
            assert len(a.received) == f.metric("kvconnect_router_retries_total", role="unified") > 0

    run(scenario, "a", "b")


def test_attempts_are_bounded_and_then_the_client_gets_503() -> None:
    async def scenario(a: StandIn, b: StandIn, c: StandIn) -> None:
        async with front(unified=(a.url, b.url, c.url), max_attempts=2) as f:
            a.fail_status = b.fail_status = c.fail_status = 500
            status, data, _ = await f.post("/v1/completions", {"prompt": "doomed"})
            assert status == 503
            assert "answered 500" in json.loads(data)["error"]["message"]
            assert len(a.received) + len(b.received) + len(c.received) == 2

    run(scenario, "a", "b", "c")


def test_an_answer_that_breaks_after_its_first_bytes_is_never_retried() -> None:
    async def scenario(a: StandIn, b: StandIn) -> None:
        async with front(unified=(a.url, b.url)) as f:
            a.break_after = b.break_after = 3
            with pytest.raises(aiohttp.ClientPayloadError):
                await f.post("/v1/completions", {"prompt": "truncated", "stream": True})
            assert len(a.received) + len(b.received) == 1
            assert f.metric("kvconnect_router_retries_total", role="unified") == 0
            outcome = {"endpoint": "/v1/completions", "outcome": "upstream_error"}
            await await_for(
                lambda: f.metric("kvconnect_router_requests_total", **outcome) == 1,
                "the broken answer is counted",
            )

    run(scenario, "a", "b")


def test_a_client_going_away_mid_stream_closes_the_upstream_request() -> None:
    async def scenario(a: StandIn) -> None:
        async with front(unified=(a.url,)) as f:
            a.hold_after = 2
            async with f.client.post(
                f.url + "/v1/completions", json={"prompt": "abandoned", "stream": True}
            ) as reply:
                assert reply.status == 200
                assert (await reply.content.readany()).startswith(b"data: ")
            # leaving the block closes the client's connection mid-answer
            await await_for(lambda: a.cancelled == 1, "the instance's request is cancelled")
            outcome = {"endpoint": "/v1/completions", "outcome": "aborted"}
            await await_for(
                lambda: f.metric("kvconnect_router_requests_total", **outcome) == 1,
                "the abandoned request is counted",
            )
            assert f.service.fleet.get(a.url).inflight == 0

    run(scenario, "a")


def test_kv_events_steer_a_request_to_the_instance_holding_its_prefix() -> None:
    prompt = "a shared system prompt, then the user's question"[:48]  # 12 blocks of 4 tokens
    tokens = list(prompt.encode())  # how the stand-ins tokenise
    stored = BlockStored(
        block_hashes=list(range(1000, 1012)),
        parent_block_hash=None,
        token_ids=tokens,
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    publisher = KvEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 100)

    async def scenario(a: StandIn, b: StandIn) -> None:
        publisher.start()
        try:
            publisher.publish([stored])  # before the router starts: replayed as history
            await await_for(lambda: publisher.stats.published == 1, "published")
            events = (EventSource(b.url, publisher.endpoint, publisher.replay_endpoint),)
            settings = {"unified": (a.url, b.url), "events": events, "block_size": 4}
            async with front(**settings, policy="cache") as f:
                await await_for(lambda: f.service.router.index_entries() == 12, "indexed")
                batches = f.metric("kvconnect_router_events_batches_total", source=b.url)
                assert batches == f.metric("kvconnect_router_events_replayed_total", source=b.url)
                assert batches == 1
                for _ in range(3):
                    status, data, _ = await f.post("/v1/completions", {"prompt": prompt})
                    assert (status, json.loads(data)) == (200, answer(prompt, "b"))
                assert f.metric("kvconnect_router_cached_blocks_total", tier="instance") == 36
                await b.stop()  # its next request fails to connect: out, and out of the index
                status, data, _ = await f.post("/v1/completions", {"prompt": prompt})
                assert (status, json.loads(data)) == (200, answer(prompt, "a"))
                assert f.service.router.index_entries() == 0
        finally:
            publisher.close()

    run(scenario, "a", "b")


def test_the_health_loop_takes_a_dead_instance_out_and_back_in() -> None:
    async def scenario(a: StandIn, b: StandIn) -> None:
        async with front(unified=(a.url, b.url), health_interval=0.05) as f:

            def health() -> dict[str, Any]:
                return {i.url: i.healthy for i in f.service.fleet.instances()}

            assert health() == {a.url: True, b.url: True}
            await a.stop()
            await await_for(lambda: not health()[a.url], "the dead instance goes out")
            status, data = await f.get("/health")
            assert (status, json.loads(data)["instances"]) == (200, {a.url: False, b.url: True})
            b.healthy = False  # /health 503: out too, nothing left
            await await_for(lambda: not health()[b.url], "an instance failing /health goes out")
            assert (await f.get("/health"))[0] == 503
            status, data, _ = await f.post("/v1/completions", {"prompt": "nobody"})
            assert status == 503
            await a.start()  # same port
            await await_for(lambda: health()[a.url], "the instance comes back when healthy")
            status, data, _ = await f.post("/v1/completions", {"prompt": "back"})
            assert (status, json.loads(data)) == (200, answer("back", "a"))

    run(scenario, "a", "b")


def test_an_instance_whose_health_check_hangs_is_taken_out_by_the_checks_timeout() -> None:
    async def scenario(a: StandIn, b: StandIn) -> None:
        settings = {"health_interval": 0.05, "health_timeout": 0.2}
        async with front(unified=(a.url, b.url), **settings) as f:
            a.hang = True
            await await_for(lambda: not f.service.fleet.get(a.url).healthy, "a hung instance")
            assert f.service.fleet.get(b.url).healthy
            a.hang = False
            await await_for(lambda: f.service.fleet.get(a.url).healthy, "back when it answers")

    run(scenario, "a", "b")


def test_a_request_predicted_over_the_ttft_slo_is_answered_429_before_dispatch() -> None:
    async def scenario(a: StandIn) -> None:
        async with front(unified=(a.url,), policy="cache", ttft_slo=1e-9) as f:
            status, data, headers = await f.post("/v1/completions", {"prompt": "x" * 4000})
            assert status == 429
            assert int(headers["Retry-After"]) >= 1
            assert json.loads(data)["error"]["type"] == "slo_rejection"
            assert a.received == []
            assert f.metric("kvconnect_router_rejections_total", reason="ttft") == 1

    run(scenario, "a")


def test_hostile_input_is_refused_cleanly_and_reaches_no_instance() -> None:
    async def scenario(a: StandIn) -> None:
        async with front(unified=(a.url,), max_body_bytes=1 << 16) as f:
            for body in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
                status, data, _ = await f.post("/v1/completions", body)
                assert status == 400, body
                assert json.loads(data)["error"]["code"] == 400
            status, _, _ = await f.post("/v1/chat/completions", b"x" * (1 << 17))
            assert status == 413
            assert (await f.get("/v1/unknown"))[0] == 404
            assert (await f.get("/v1/completions"))[0] == 405
            assert a.received == []
            status, data, _ = await f.post("/v1/completions", {"prompt": "still fine"})
            assert (status, json.loads(data)) == (200, answer("still fine", "a"))

    run(scenario, "a")


def test_an_instances_refusal_is_relayed_as_it_is() -> None:
    async def scenario(p: StandIn, d: StandIn) -> None:
        async with front(prefill=(p.url,), decode=(d.url,)) as f:
            body = {"prompt": "bad", "max_completion_tokens": 3, "max_tokens": -1}
            status, data, _ = await f.post("/v1/completions", body)
            # prefill's max_tokens is forced to 1: decode sees the client's own value
            assert (status, json.loads(data)) == (400, {"error": "max_tokens must be >= 1"})
            assert p.received[0][1]["max_completion_tokens"] == 1

    run(scenario, "p", "d")


def test_models_health_and_metrics_endpoints() -> None:
    async def scenario(a: StandIn) -> None:
        async with front(unified=(a.url,)) as f:
            status, data = await f.get("/v1/models")
            assert (status, json.loads(data)["data"][0]["id"]) == (200, MODEL)
            status, data = await f.get("/health")
            assert (status, json.loads(data)) == (200, {"ready": True, "instances": {a.url: True}})
            await f.post("/v1/completions", {"prompt": "count me"})
            status, data = await f.get("/metrics")
            text = data.decode()
            assert status == 200
            assert (
                'kvconnect_router_requests_total{endpoint="/v1/completions",outcome="ok"} 1.0'
                in text
            )
            assert (
                f'kvconnect_router_decisions_total{{instance="{a.url}",role="unified"}} 1.0' in text
            )
            assert "kvconnect_router_index_entries 0.0" in text

    run(scenario, "a")


def test_instance_load_comes_from_its_metrics_and_inflight_is_counted_back_to_zero() -> None:
    async def scenario(a: StandIn) -> None:
        a.running, a.waiting = 3, 2
        async with front(unified=(a.url,)) as f:
            load = f.service.fleet.get(a.url).load
            assert (load.running, load.waiting, load.kv_usage) == (3, 2, 0.25)
            await asyncio.gather(*(f.post("/v1/completions", {"prompt": f"{n}"}) for n in range(5)))
            instance = f.service.fleet.get(a.url)
            assert (instance.inflight, instance.inflight_tokens) == (0, 0)

    run(scenario, "a")


def test_the_routers_own_requests_a_scrape_may_count_are_remembered_with_it() -> None:
    async def scenario(a: StandIn) -> None:
        async with front(unified=(a.url,)) as f:
            fleet = f.service.fleet
            instance = fleet.get(a.url)
            assert instance.ours_in_load == 0
            ticket = fleet.begin(a.url, 10)  # in flight (perhaps waiting) during the scrape
            a.waiting = 1
            await fleet.check_all()
            ticket.close()  # finished since: the scraped waiting=1 was the router's own
            assert (instance.inflight, instance.load.waiting, instance.ours_in_load) == (0, 1, 1)
            a.waiting = 0
            await fleet.check_all()
            assert instance.ours_in_load == 0

    run(scenario, "a")
