"""The router's HTTP front (aiohttp): OpenAI-compatible endpoints in front of a vLLM fleet.

- ``POST /v1/completions``, ``POST /v1/chat/completions``: the body is passed through as sent
  (fields the router does not know included). The prompt is tokenised by an instance's own
  ``/tokenize`` (chat template included) so the router's hash chain matches the engines'; on
  failure the request is routed by load alone. Then, before anything is dispatched, the SLO
  check (429 with ``Retry-After``). A PD request goes to prefill with NIXL's
  ``kv_transfer_params`` (``do_remote_decode``, ``max_tokens: 1``, no streaming) and, with the
  params of prefill's answer, to decode, whose answer (streamed or not) is relayed chunk by
  chunk; a unified instance takes the request in one hop. Retries: :mod:`.relay`.
- ``GET /v1/models``: a healthy instance's answer. ``GET /health``: 200 while a request can be
  served (a unified instance, or a prefill and a decode), 503 otherwise. ``GET /metrics``: the
  router's own series.

Client errors: a body that is not a JSON object is 400, a body over ``max_body_bytes`` 413,
an unknown path 404; an instance's 4xx answer is relayed as it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from kvconnect.errors import PeerUnreachable, ProtocolError
from kvconnect.router import upstream
from kvconnect.router.config import RouterConfig
from kvconnect.router.cost import Estimate
from kvconnect.router.events import EventSubscriber
from kvconnect.router.instances import Fleet
from kvconnect.router.metrics import CONTENT_TYPE, Outcome, RouterMetrics
from kvconnect.router.relay import Failed, Hop, Relay, error, outcome_of
from kvconnect.router.routing import STORE, Router
from kvconnect.router.types import Choice, Request, Role

log = logging.getLogger(__name__)

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What a prefill hop asks for (NIXL's protocol: keep the blocks for a remote decode)."""

FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
"""Client headers passed on to the instances (vLLM's ``--api-key``, request ids)."""

_CHAT_TOKENIZE_KEYS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)  # fields of a chat request that change its tokens (vLLM's TokenizeChatRequest)

KEEPALIVE = 4.0
"""Seconds an idle upstream connection is kept: below uvicorn's default keep-alive (5 s, what
vLLM's API server runs with), so the router never sends on a connection vLLM is closing."""

_STATE: web.AppKey[RouterService] = web.AppKey("router")


class RouterService:
    """The router's state for one application: session, fleet, decisions, metrics.

    Built and closed by the application's startup and cleanup (:func:`make_app`)."""

    def __init__(self, config: RouterConfig, session: aiohttp.ClientSession) -> None:
        self.config = config
        self.session = session
        self.fleet = Fleet(
            config.roles(),
            session,
            interval=config.health_interval,
            timeout=config.health_timeout,
            unhealthy_after=config.unhealthy_after,
        )
        self.router = Router(config, self.fleet)
        self.subscribers: list[EventSubscriber] = []
        self.metrics = RouterMetrics(
            self.router.index_entries, lambda: {s.name: s.stats for s in self.subscribers}
        )
        self.fleet.listen(self.metrics.instance_changed)
        timeout = aiohttp.ClientTimeout(
            total=config.request_timeout, connect=config.connect_timeout
        )
        self.relay = Relay(
            session, self.fleet, self.metrics, timeout=timeout, max_attempts=config.max_attempts
        )
        sources = [*config.events, *([config.store_events] if config.store_events else [])]
        self.subscribers += [
            EventSubscriber(
                source.instance or STORE,
                source.endpoint,
                source.replay,
                self.router.apply_events,
                timeout=config.health_timeout,
                on_reset=self.router.publisher_reset,
            )
            for source in sources
        ]

    async def start(self) -> None:
        """The event subscribers, the first health round, then the health loop."""
        for instance in self.fleet.instances():
            self.metrics.instance_changed(instance)
        for subscriber in self.subscribers:
            subscriber.start()
        await self.fleet.start()

    async def close(self) -> None:
        """Stop the health loop and the subscribers, close the session."""
        await self.fleet.close()
        for subscriber in self.subscribers:
            await asyncio.to_thread(subscriber.close)
        await self.session.close()


def make_app(config: RouterConfig) -> web.Application:
    """The aiohttp application of a router configured by ``config`` (not yet running)."""
    app = web.Application(client_max_size=config.max_body_bytes)

    async def lifecycle(app: web.Application) -> Any:
        # No connection limit: every streamed answer holds one connection while it lasts.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE)
        service = RouterService(config, aiohttp.ClientSession(connector=connector))
        app[_STATE] = service
        try:
            await service.start()
            yield
        finally:
            await service.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", _generate)
    app.router.add_post("/v1/chat/completions", _generate)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


def make_runner(config: RouterConfig) -> web.AppRunner:
    """A runner of :func:`make_app`: a request whose client goes away is cancelled, which
    closes its upstream connection (vLLM then aborts it)."""
    return web.AppRunner(make_app(config), handle_signals=False, handler_cancellation=True)


def service_of(app: web.Application) -> RouterService:
    """The running router's state (tests read its fleet and metrics)."""
    return app[_STATE]


async def _health(request: web.Request) -> web.Response:
    fleet = request.app[_STATE].fleet
    instances = {i.url: i.healthy for i in fleet.instances()}
    status = 200 if fleet.ready() else 503
    return web.json_response({"ready": status == 200, "instances": instances}, status=status)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[_STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _models(request: web.Request) -> web.Response:
    service = request.app[_STATE]
    instances = service.fleet.healthy(*Role)
    if not instances:
        return error(503, "no healthy instance")
    url = min(instances, key=lambda i: i.inflight).url + "/v1/models"
    timeout = aiohttp.ClientTimeout(total=service.config.call_timeout)
    try:
        async with service.session.get(url, headers=_forwarded(request), timeout=timeout) as reply:
            body = await upstream.read_limited(reply)
            return web.Response(status=reply.status, body=body, content_type=reply.content_type)
    except upstream.CONNECTION_ERRORS as exc:
        return error(502, f"{url}: {exc!r}")


async def _generate(request: web.Request) -> web.StreamResponse:
    service = request.app[_STATE]
    endpoint = request.path
    try:
        response, outcome = await _serve(service, request)
    except web.HTTPException as exc:  # 413 from reading an oversized body
        service.metrics.requests.labels(endpoint, Outcome.CLIENT_ERROR).inc()
        raise exc from None
    except asyncio.CancelledError:  # the client went away (handler cancellation)
        service.metrics.requests.labels(endpoint, Outcome.ABORTED).inc()
        raise
    except Failed as exc:
        response, outcome = exc.response(), exc.outcome
    service.metrics.requests.labels(endpoint, outcome).inc()
    return response


async def _serve(service: RouterService, client: web.Request) -> tuple[web.StreamResponse, Outcome]:
    raw, body = await _json_body(client)
    router = service.router
    tokens = await _tokens(service, client, body)
    req = router.request(tokens, str(body.get("model", "")))
    first = router.first_hop(req)
    if first is None:
        raise Failed(503, "no healthy instance", Outcome.UNAVAILABLE)
    role = service.fleet.get(first.instance).role
    decode = router.decode(req) if role is Role.PREFILL else None
    if role is Role.PREFILL and decode is None:
        raise Failed(503, "no healthy decode instance", Outcome.UNAVAILABLE)
    rejection = router.admit(req, first, decode)
    if rejection is not None:
        service.metrics.rejections.labels(rejection.reason).inc()
        answer = error(429, f"over the SLO: {rejection.reason}", "slo_rejection")
        answer.headers["Retry-After"] = str(max(1, math.ceil(rejection.retry_after)))
        return answer, Outcome.REJECTED
    _count_decision(service, req, first)
    headers = _forwarded(client)
    if decode is None:  # one hop
        hop = Hop(client.path, raw, headers, 0)
        return await _final_hop(service, client, req, first, hop)
    params = await _prefill(service, client, body, req, first, headers)
    decode_body = dict(body, kv_transfer_params=params)
    hop = Hop(client.path, json.dumps(decode_body).encode(), headers, 0)
    _count_decision(service, req, decode)
    return await _final_hop(service, client, req, decode, hop)


async def _json_body(client: web.Request) -> tuple[bytes, dict[str, Any]]:
    """The body as sent and parsed; Failed (400) unless it is a JSON object."""
    raw = await client.read()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise Failed(400, f"the body is not JSON: {exc}", Outcome.CLIENT_ERROR) from None
    if not isinstance(body, dict):
        raise Failed(400, "the body must be a JSON object", Outcome.CLIENT_ERROR)
    return raw, body


async def _tokens(service: RouterService, client: web.Request, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids, [] when they cannot be known (batched prompts, failures)."""
    payload = _tokenize_payload(client.path, body)
    if isinstance(payload, list):
        return payload
    if payload is None:
        return []
    instances = service.fleet.healthy(*Role)
    if not instances:
        return []
    url = min(instances, key=lambda i: i.inflight).url
    try:
        return await upstream.tokenize(service.session, url, payload, service.config.call_timeout)
    except PeerUnreachable as exc:
        service.fleet.failed(url, str(exc))
        log.info("routing by load alone: %s", exc)
    except ProtocolError as exc:  # e.g. the instance refuses the prompt: it will say so again
        log.info("routing by load alone: %s", exc)
    return []


def _tokenize_payload(path: str, body: Mapping[str, Any]) -> dict[str, Any] | list[int] | None:
    """What ``/tokenize`` is asked for the request, or its token ids if it sent them."""
    base = {"model": body["model"]} if "model" in body else {}
    if path.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list):
            return None
        extra = {k: body[k] for k in _CHAT_TOKENIZE_KEYS if k in body}
        return {**base, "messages": body["messages"], **extra}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        extra = (
            {"add_special_tokens": body["add_special_tokens"]}
            if "add_special_tokens" in body
            else {}
        )
        return {**base, "prompt": prompt, **extra}
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return list(prompt)
    return None  # a batch of prompts: no single chain


async def _prefill(
    service: RouterService,
    client: web.Request,
    body: dict[str, Any],
    req: Request,
    first: Choice,
    headers: Mapping[str, str],
) -> object:
    """Prefill's ``kv_transfer_params`` for the request (prefill retried while not started)."""
    prefill_body = dict(body, stream=False, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
    prefill_body.pop("stream_options", None)
    if "max_completion_tokens" in body:
        prefill_body["max_completion_tokens"] = 1
    data = json.dumps(prefill_body).encode()
    router = service.router

    async def send(choice: Choice) -> tuple[int, str, bytes]:
        estimate = router.estimate(req, choice)
        hop = Hop(client.path, data, headers, estimate.compute_tokens)
        begun = time.monotonic()
        answer = await service.relay.call(choice, hop)
        if answer[0] == 200:
            _first_token(service, choice, estimate, time.monotonic() - begun)
        return answer

    role = service.fleet.get(first.instance).role
    _, (status, content_type, reply) = await service.relay.attempts(
        first, lambda tried: router.retry(role, req, tried), role, send
    )
    if status != 200:
        message = f"prefill answered {status}"  # a refusal of the request: relayed as it is
        raise Failed(status, message, outcome_of(status), body=reply, content_type=content_type)
    try:
        return json.loads(reply).get("kv_transfer_params")
    except (ValueError, AttributeError):
        raise Failed(502, "prefill answered with no JSON object", Outcome.UPSTREAM_ERROR) from None


async def _final_hop(
    service: RouterService,
    client: web.Request,
    req: Request,
    first: Choice,
    hop: Hop,
) -> tuple[web.StreamResponse, Outcome]:
    """The hop whose answer the client gets (decode, or a unified instance that also computes
    the prompt), relayed. A streamed answer calibrates the cost model: a unified instance's
    first byte is its TTFT, and the events after it give the TBT."""
    router = service.router
    role = service.fleet.get(first.instance).role

    async def send(choice: Choice) -> tuple[web.StreamResponse, Outcome]:
        estimate = router.estimate(req, choice)
        load = router.decode_load(choice)
        unified = role is Role.UNIFIED

        def started(seconds: float) -> None:
            if unified:
                _first_token(service, choice, estimate, seconds)

        def finished(seconds: float, events: int) -> None:
            router.decoded(choice, load, seconds, events - 1)  # less the closing [DONE]

        tokens = estimate.compute_tokens if unified else 0
        return await service.relay.stream(
            client, choice, dataclasses.replace(hop, tokens=tokens), started, finished
        )

    _, answer = await service.relay.attempts(
        first, lambda tried: router.retry(role, req, tried), role, send
    )
    return answer


def _first_token(
    service: RouterService, choice: Choice, estimate: Estimate, seconds: float
) -> None:
    """A prompt estimated as ``estimate`` was computed in ``seconds`` at ``choice``."""
    service.router.prefilled(choice, estimate, seconds)
    service.metrics.ttft_predicted.observe(estimate.seconds)
    service.metrics.ttft_observed.observe(seconds)


def _forwarded(client: web.Request) -> dict[str, str]:
    return {name: client.headers[name] for name in FORWARDED_HEADERS if name in client.headers}


def _count_decision(service: RouterService, req: Request, choice: Choice) -> None:
    role = service.fleet.get(choice.instance).role
    service.metrics.decisions.labels(choice.instance, role.value).inc()
    if role is not Role.DECODE:
        service.metrics.prompt_blocks.inc(len(req.blocks))
        service.metrics.cached_blocks.labels("instance").inc(choice.cached_blocks)
        service.metrics.cached_blocks.labels("pool").inc(req.pool_blocks)
