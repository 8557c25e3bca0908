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

from kvconnect.router.app import RouterService, make_app, service_of
from kvconnect.router.config import RouterConfig
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
    runner = web.AppRunner(make_app(RouterConfig(**settings)), handle_signals=False)
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
        async with front(unified=(a.url, b.url)) as f:
            await a.stop()
            prompts = [f"prompt {n}" for n in range(4)]
            for prompt in prompts:
                status, data, _ = await f.post("/v1/completions", {"prompt": prompt})
                assert status == 200
                assert json.loads(data) == answer(prompt, "b")
            assert [body["prompt"] for _, body in b.received] == prompts
            assert not f.service.fleet.get(a.url).healthy
            assert f.metric("kvconnect_router_retries_total", role="unified") == 1
            assert (
                f.metric("kvconnect_router_instance_healthy", instance=a.url, role="unified") == 0
            )

    run(scenario, "a", "b")


def test_a_pd_hop_whose_connection_closes_before_an_answer_is_retried_on_another_instance() -> None:
    async def scenario(p1: StandIn, p2: StandIn, d1: StandIn, d2: StandIn) -> None:
        async with front(prefill=(p1.url, p2.url), decode=(d1.url, d2.url)) as f:
            p1.drop = d1.drop = True
            for n in range(3):
                status, data, _ = await f.post("/v1/completions", {"prompt": f"p{n}"})
                assert status == 200
                assert json.loads(data) == answer(f"p{n}", "d2", prefilled_by="p2")
            assert len(p1.received) == len(d1.received) == 1  # tried once, then out
            assert len(p2.received) == len(d2.received) == 3
            assert f.metric("kvconnect_router_retries_total", role="prefill") == 1
            assert f.metric("kvconnect_router_retries_total", role="decode") == 1

    run(scenario, "p1", "p2", "d1", "d2")


def test_a_5xx_before_any_byte_is_retried_and_the_instance_stays_in() -> None:
    async def scenario(a: StandIn, b: StandIn) -> None:
        async with front(unified=(a.url, b.url)) as f:
            a.fail_status = 503
            for n in range(2):
                status, data, _ = await f.post("/v1/completions", {"prompt": f"x{n}"})
                assert (status, json.loads(data)) == (200, answer(f"x{n}", "b"))
            assert f.service.fleet.get(a.url).healthy
            assert len(a.received) == 1

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
