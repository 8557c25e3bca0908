"""``kvconnect router``: flags → :class:`~kvconnect.router.config.RouterConfig`, then the
router serves until SIGINT or SIGTERM.

Once listening it prints one JSON line, ``{"router": "http://host:port"}`` (the bound port
when ``--port 0``), so scripts can wait for it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

from aiohttp import web

from kvconnect.errors import ConfigError
from kvconnect.router.app import make_app
from kvconnect.router.config import EventSource, PolicyName, RouterConfig

_DEFAULTS = RouterConfig(unified=("http://defaults.invalid",))


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
    routing.add_argument("--policy", default=d.policy.value, choices=[p.value for p in PolicyName])
    routing.add_argument("--ttft-slo", type=float, metavar="S", help="reject above this TTFT")
    routing.add_argument("--tbt-slo", type=float, metavar="S", help="reject above this TBT")
    routing.add_argument("--block-size", type=int, default=d.block_size, help="engines' block size")
    routing.add_argument("--index-capacity", type=int, default=d.index_capacity)
    routing.add_argument("--prefill-tps", type=float, default=d.prefill_tps)
    routing.add_argument("--pool-tps", type=float, default=d.pool_tps)
    routing.add_argument("--decode-tbt", type=float, default=d.decode_tbt)
    routing.add_argument("--k-waiting", type=float, default=d.k_waiting)
    routing.add_argument("--seed", type=int, default=d.seed, help="seed of --policy random")
    serving = parser.add_argument_group("serving")
    serving.add_argument("--host", default=d.host)
    serving.add_argument("--port", type=int, default=d.port)
    serving.add_argument("--health-interval", type=float, default=d.health_interval)
    serving.add_argument("--health-timeout", type=float, default=d.health_timeout)
    serving.add_argument("--unhealthy-after", type=int, default=d.unhealthy_after)
    serving.add_argument("--request-timeout", type=float, default=d.request_timeout)
    serving.add_argument("--connect-timeout", type=float, default=d.connect_timeout)
    serving.add_argument("--tokenize-timeout", type=float, default=d.tokenize_timeout)
    serving.add_argument("--max-attempts", type=int, default=d.max_attempts)
    serving.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The configuration the flags give; ConfigError if it is invalid."""
    events = []
    for item in args.events:
        url, sep, endpoints = item.partition("=")
        if not sep:
            raise ConfigError(f"--events takes URL=ENDPOINT[,REPLAY], got {item!r}")
        events.append(EventSource.parse(url, endpoints))
    store = EventSource.parse("", args.store_events) if args.store_events else None
    return RouterConfig(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        unified=tuple(args.unified),
        events=tuple(events),
        store_events=store,
        policy=args.policy,
        ttft_slo=args.ttft_slo,
        tbt_slo=args.tbt_slo,
        host=args.host,
        port=args.port,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        unhealthy_after=args.unhealthy_after,
        request_timeout=args.request_timeout,
        connect_timeout=args.connect_timeout,
        tokenize_timeout=args.tokenize_timeout,
        max_attempts=args.max_attempts,
        max_body_bytes=args.max_body_bytes,
        block_size=args.block_size,
        index_capacity=args.index_capacity,
        prefill_tps=args.prefill_tps,
        pool_tps=args.pool_tps,
        decode_tbt=args.decode_tbt,
        k_waiting=args.k_waiting,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    """``kvconnect router``: serve until SIGINT or SIGTERM."""
    asyncio.run(serve(config_from_args(args)))
    return 0


async def serve(config: RouterConfig) -> None:
    """Run the router of ``config`` until SIGINT or SIGTERM."""
    runner = web.AppRunner(make_app(config), handle_signals=False)
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
