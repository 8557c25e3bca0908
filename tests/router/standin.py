"""Real aiohttp servers standing in for vLLM's HTTP surface, for tests of the router's front.

A stand-in answers what the router calls: ``/health``, ``/metrics`` (vLLM's gauges),
``/tokenize`` (one token per UTF-8 byte of the prompt, or of the messages' contents),
``/v1/models`` and the two generation endpoints. Its completion is a pure function of the
prompt (the prompt reversed), the same on every stand-in, so an answer proves it is exact
whichever instance gave it. In PD, a prefill answers ``kv_transfer_params`` naming itself, and
a decode says in its answer whose params it got. Faults: :meth:`StandIn.stop` (connection
refused), ``drop`` (the connection closes before an answer), ``fail_status`` (a 5xx answer),
``break_after`` (the stream breaks after that many chunks), ``hold_after`` (the stream stops
after that many chunks until the router gives up: ``cancelled`` counts those), ``healthy``
(``/health`` 503), ``hang`` (``/health`` never answers).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

MODEL = "standin-model"


def completion_text(prompt: str) -> str:
    """What every stand-in completes ``prompt`` with."""
    return prompt[::-1]


def prompt_of(body: dict[str, Any]) -> str:
    """The prompt of a completions or chat body, as the stand-ins see it."""
    if "messages" in body:
        return "".join(str(m.get("content", "")) for m in body["messages"])
    return str(body.get("prompt", ""))


class StandIn:
    """One stand-in instance on 127.0.0.1 (a free port, kept across :meth:`stop`/:meth:`start`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = 0
        self.received: list[tuple[str, dict[str, Any]]] = []  # generation requests
        self.headers: list[dict[str, str]] = []
        self.healthy = True
        self.hang = False
        self.drop = False
        self.fail_status: int | None = None
        self.break_after: int | None = None
        self.hold_after: int | None = None
        self.cancelled = 0
        self.running = 0
        self.waiting = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Close the listening socket and every connection: connections are refused now."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, _request: web.Request) -> web.Response:
        if self.hang:
            await asyncio.Event().wait()  # until the caller gives up and closes
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        labels = f'engine="0",model_name="{MODEL}"'
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {self.running}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} {self.waiting}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.25\n"
        )
        return web.Response(text=text)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"tokens": list(prompt_of(body).encode()), "count": 0})

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "owned_by": self.name}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append((request.path, body))
        self.headers.append(dict(request.headers))
        if self.drop:
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if self.fail_status is not None:
            return web.json_response({"error": "injected"}, status=self.fail_status)
        if body.get("max_tokens") == -1:
            return web.json_response({"error": "max_tokens must be >= 1"}, status=400)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            return web.json_response(
                {"id": "p", "kv_transfer_params": {"remote_engine_id": self.name, "blocks": [1]}}
            )
        text = completion_text(prompt_of(body))
        extra = {"prefilled_by": params.get("remote_engine_id"), "served_by": self.name}
        if not body.get("stream"):
            return web.json_response({"id": "c", "choices": [{"text": text}], **extra})
        return await self._stream(request, text, extra)

    async def _stream(
        self, request: web.Request, text: str, extra: dict[str, Any]
    ) -> web.StreamResponse:
        out = web.StreamResponse()
        out.content_type = "text/event-stream"
        await out.prepare(request)
        for position, char in enumerate(text):
            if self.break_after is not None and position == self.break_after:
                assert request.transport is not None
                request.transport.close()
                return out
            if position == self.hold_after:
                await self._hold()
            event = {"choices": [{"text": char}], **extra}
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def _hold(self) -> None:
        try:
            await asyncio.Event().wait()  # until the router closes the connection
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def stream_bytes(text: str, extra: dict[str, Any]) -> bytes:
    """The exact body a stand-in streams for completion ``text``."""
    events = [f"data: {json.dumps({'choices': [{'text': c}], **extra})}\n\n" for c in text]
    return "".join(events).encode() + b"data: [DONE]\n\n"
