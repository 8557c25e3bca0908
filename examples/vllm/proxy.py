"""A small OpenAI-compatible proxy for prefill/decode disaggregation with kvconnect.

Each request goes to a prefill server with ``kv_transfer_params.do_remote_decode`` and
``max_tokens=1``; the ``kv_transfer_params`` in its answer go with the original request to a
decode server, whose answer (streamed or not) is relayed. Servers are picked round-robin.
The protocol is NIXL's, so the same proxy drives vLLM's NixlConnector.

    python proxy.py --port 8000 --prefill http://p1:8100 --decode http://d1:8200 [...]

Needs aiohttp (installed with vLLM).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

log = logging.getLogger("kvconnect.proxy")

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float) -> None:
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self._timeout = ClientTimeout(total=timeout)
        self._session: ClientSession | None = None

    async def start(self, _app: web.Application) -> None:
        self._session = ClientSession(timeout=self._timeout)

    async def stop(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body: dict[str, Any] = await request.json()
        path = request.path
        prefill_body = dict(body, stream=False, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        async with self._session.post(next(self._prefill) + path, json=prefill_body) as reply:
            if reply.status != 200:
                return web.Response(status=reply.status, body=await reply.read())
            prefilled = await reply.json()
        decode_body = dict(body, kv_transfer_params=prefilled.get("kv_transfer_params"))
        async with self._session.post(next(self._decode) + path, json=decode_body) as reply:
            if not body.get("stream"):
                return web.Response(
                    status=reply.status,
                    body=await reply.read(),
                    content_type="application/json",
                )
            out = web.StreamResponse(status=reply.status)
            out.content_type = "text/event-stream"
            await out.prepare(request)
            async for chunk in reply.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", nargs="+", required=True, help="prefill server URLs")
    parser.add_argument("--decode", nargs="+", required=True, help="decode server URLs")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    proxy = Proxy(args.prefill, args.decode, args.timeout)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_get("/healthcheck", proxy.health)
    app.router.add_post("/v1/completions", proxy.handle)
    app.router.add_post("/v1/chat/completions", proxy.handle)
    print(json.dumps({"proxy": f"http://{args.host}:{args.port}"}), flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
