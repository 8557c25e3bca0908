"""``kvconnect router``: flags → :class:`~kvconnect.router.config.RouterConfig`, then the
router serves until SIGINT or SIGTERM.

Once listening it prints one JSON line, ``{"router": "http://host:port"}`` (the bound port
when ``--port 0``), so scripts can wait for it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal

from aiohttp import web

from kvconnect.errors import ConfigError
from kvconnect.router.app import make_runner
from kvconnect.router.config import EventSource, PolicyName, RouterConfig

_DEFAULTS = RouterConfig(unified=("http://defaults.invalid",))
_FLEET_FIELDS = ("prefill", "decode", "unified", "events", "store_events")  # parsed, not copied


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags (cli.py declares them when ``kvconnect router`` is parsed)."""
    d = _DEFAULTS
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill instances")
    fleet.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode instances")
    fleet.add_argument(
        "--unified", nargs="+", default=[], metavar="URL", help="instances serving in one hop"
    )
    fleet.add_argument(
        "--events",
        nargs="+",
        default=[],
        metavar="URL=ENDPOINT[,REPLAY]",
        help="an instance's KV events (vLLM --kv-events-config endpoint and replay endpoint)",
    )
    fleet.add_argument(
        "--store-events", metavar="ENDPOINT[,REPLAY]", help="the store master's KV events"
    )
    routing = parser.add_argument_group("routing")
    routing.add_argument(
        "--policy",
        default=d.policy.value,
        choices=[p.value for p in PolicyName],
        help="cache: by predicted TTFT and decode load; round-robin; random (default cache)",
    )
    routing.add_argument("--ttft-slo", type=float, metavar="S", help="answer 429 above this TTFT")
    routing.add_argument("--tbt-slo", type=float, metavar="S", help="answer 429 above this TBT")
    _flag(routing, "block_size", int, "tokens per KV block: the engines' --block-size")
    _flag(routing, "index_capacity", int, "block hashes the prefix index keeps at most")
    _flag(routing, "prefill_tps", float, "prior prefill tokens/s (calibrated per instance)")
    _flag(routing, "prefill_overhead", float, "prior fixed seconds of a prefill (calibrated)")
    _flag(routing, "pool_tps", float, "tokens/s loaded from the shared pool")
    _flag(routing, "decode_tbt", float, "prior seconds per token of one sequence alone")
    _flag(routing, "k_waiting", float, "decode load: running + K x waiting")
    _flag(routing, "seed", int, "seed of --policy random")
    serving = parser.add_argument_group("serving")
    serving.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    _flag(serving, "port", int, "port to listen on (0: any free one)")
    _flag(serving, "health_interval", float, "seconds between health checks")
    _flag(serving, "health_timeout", float, "seconds a health check may take")
    _flag(serving, "unhealthy_after", int, "failed checks in a row that take an instance out")
    _flag(serving, "request_timeout", float, "seconds an upstream generation call may take")
    _flag(serving, "connect_timeout", float, "seconds to connect to an instance")
    _flag(serving, "call_timeout", float, "seconds a /tokenize or /v1/models call may take")
    _flag(serving, "max_attempts", int, "instances tried per hop for a request not yet started")
    _flag(serving, "max_body_bytes", int, "largest request body (413 beyond)")


def _flag(group: argparse._ArgumentGroup, name: str, kind: type, summary: str) -> None:
    """``--name`` of RouterConfig field ``name``, with its default."""
    default = getattr(_DEFAULTS, name)
    flag = "--" + name.replace("_", "-")
    group.add_argument(flag, type=kind, default=default, help=f"{summary} (default {default})")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The configuration the flags give; ConfigError if it is invalid."""
    events = []
    for item in args.events:
        url, sep, endpoints = item.partition("=")
        if not sep:
            raise ConfigError(f"--events takes URL=ENDPOINT[,REPLAY], got {item!r}")
        events.append(EventSource.parse(url, endpoints))
    store = EventSource.parse("", args.store_events) if args.store_events else None
    flagged = {  # every other field is a flag of its own name
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(RouterConfig)
        if f.name not in _FLEET_FIELDS and hasattr(args, f.name)
    }
    return RouterConfig(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        unified=tuple(args.unified),
        events=tuple(events),
        store_events=store,
        **flagged,
    )


def run(args: argparse.Namespace) -> int:
    """``kvconnect router``: serve until SIGINT or SIGTERM."""
    asyncio.run(serve(config_from_args(args)))
    return 0


async def serve(config: RouterConfig) -> None:
    """Run the router of ``config`` until SIGINT or SIGTERM."""
    runner = make_runner(config)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        port = runner.addresses[0][1]
        print(json.dumps({"router": f"http://{config.host}:{port}"}), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
