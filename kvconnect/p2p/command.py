"""``kvconnect p2p …``: publish a directory, fetch an object, list what is published,
withdraw a version.

Settings come, lowest precedence first, from ``--config`` (a JSON object of
:class:`~kvconnect.p2p.P2PConfig` keys), ``KVCONNECT_P2P_<KEY>`` variables, then the flags.
``publish`` and ``fetch --seed`` serve until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvconnect.errors import KVConnectError
from kvconnect.p2p.config import P2PConfig
from kvconnect.p2p.destination import Files
from kvconnect.p2p.fetch import FetchStats
from kvconnect.p2p.node import P2PNode

_FLAGS = (  # flag, config key, type, help
    ("--etcd", "etcd", str, "etcd of the swarm (etcd://host:port[,host:port])"),
    ("--prefix", "prefix", str, "key prefix of the swarm in etcd"),
    ("--listen-host", "listen_host", str, "interface this node serves chunks on"),
    ("--advertise-host", "advertise_host", str, "address peers dial (with a wildcard listen)"),
    ("--locality", "locality", str, "this node's rack or zone (near holders are preferred)"),
    ("--chunk-bytes", "chunk_bytes", int, "chunk size when publishing"),
    ("--parallel", "parallel", int, "chunks fetched at once"),
    ("--token-file", "token_file", str, "file with the swarm's token"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``publish``, ``fetch`` and ``ls`` with the shared options."""
    commands = parser.add_subparsers(dest="p2p", required=True, metavar="ACTION")
    publish = commands.add_parser("publish", help="publish a directory and serve it")
    publish.add_argument("directory", type=Path)
    publish.add_argument("--name", required=True, help="the object's name")
    publish.add_argument("--version", help="its version (default: named by content)")
    fetch = commands.add_parser("fetch", help="fetch an object from the swarm into a directory")
    fetch.add_argument("name")
    fetch.add_argument("directory", type=Path)
    fetch.add_argument("--version", help="the version (default: the latest)")
    fetch.add_argument("--seed", action="store_true", help="keep serving it until stopped")
    fetch.add_argument("--timeout", type=float, help="give up after this many seconds")
    fetch.add_argument(
        "--no-share",
        dest="p2p__share",
        action="store_false",
        default=None,
        help="only download: serve nothing to other nodes",
    )
    listing = commands.add_parser("ls", help="list published objects and their holders")
    remove = commands.add_parser("rm", help="withdraw a published version (no new fetches)")
    remove.add_argument("name")
    remove.add_argument("--version", help="the version (default: the latest)")
    for sub in (publish, fetch, listing, remove):
        sub.add_argument("--config", help="JSON file of p2p settings")
        sub.add_argument("--insecure", action="store_true", help="no token (trusted networks)")
        sub.add_argument("--json", action="store_true", help="print one JSON document")
        for flag, key, kind, text in _FLAGS:
            sub.add_argument(flag, dest=f"p2p__{key}", type=kind, help=text)


def config_of(args: argparse.Namespace) -> P2PConfig:
    """The file, the environment, then the flags."""
    defaults: dict[str, Any] = {}
    if args.config:
        defaults = json.loads(Path(args.config).read_text())
    flags = {
        name.removeprefix("p2p__"): value
        for name, value in vars(args).items()
        if name.startswith("p2p__") and value is not None
    }
    if args.insecure:
        flags["insecure"] = True
    return P2PConfig.from_env(defaults=defaults, **flags)


def run(args: argparse.Namespace) -> int:
    """Run the action; 1 on a P2P failure (printed), 0 otherwise."""
    try:
        with P2PNode(config_of(args)) as node:
            return int(_ACTIONS[args.p2p](node, args))
    except KVConnectError as exc:
        print(f"kvconnect p2p: {exc}", file=sys.stderr)
        return 1


def _publish(node: P2PNode, args: argparse.Namespace) -> int:
    manifest = node.publish(args.directory, args.name, args.version)
    _say(
        args,
        {
            "name": manifest.name,
            "version": manifest.version,
            "bytes": manifest.total_bytes,
            "files": len(manifest.files),
            "chunks": manifest.chunk_count,
            "segment": node.segment,
        },
        f"published {manifest.name} version {manifest.version} "
        f"({_size(manifest.total_bytes)} in {manifest.chunk_count} chunks); serving",
    )
    _serve_until_stopped()
    return 0


def _fetch(node: P2PNode, args: argparse.Namespace) -> int:
    show = _Progress() if sys.stderr.isatty() and not args.json else None
    manifest, stats = node.fetch(
        args.name, Files(args.directory), args.version, progress=show, timeout=args.timeout
    )
    if show is not None:
        show.finish()
    rate = stats.fetched_bytes / stats.seconds if stats.seconds else 0.0
    _say(
        args,
        {
            "name": manifest.name,
            "version": manifest.version,
            "bytes": manifest.total_bytes,
            "fetched_bytes": stats.fetched_bytes,
            "reused_chunks": stats.reused,
            "fetched_chunks": stats.fetched,
            "corrupt": stats.corrupt,
            "failures": stats.failures,
            "seconds": stats.seconds,
            "holders": stats.holders,
            "by_holder": stats.by_holder,
            "segment": node.segment,
        },
        f"fetched {manifest.name} version {manifest.version}: {_size(stats.fetched_bytes)} "
        f"in {stats.seconds:.1f} s ({_size(rate)}/s) from {len(stats.by_holder)} holders, "
        f"{stats.reused} chunks already here",
    )
    if args.seed:
        _serve_until_stopped()
    return 0


def _ls(node: P2PNode, args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = [
        {
            "name": item.manifest.name,
            "version": item.manifest.version,
            "bytes": item.manifest.total_bytes,
            "files": len(item.manifest.files),
            "chunks": item.manifest.chunk_count,
            "complete_holders": item.complete,
            "partial_holders": item.partial,
        }
        for item in node.listing()
    ]
    if args.json:
        print(json.dumps(rows), flush=True)
        return 0
    print(f"{'NAME':24} {'VERSION':18} {'SIZE':>10} {'FILES':>6} {'HOLDERS':>12}")
    for row in rows:
        holders = f"{row['complete_holders']}+{row['partial_holders']}"
        print(
            f"{row['name']:24} {row['version']:18} {_size(row['bytes']):>10} "
            f"{row['files']:>6} {holders:>12}"
        )
    return 0


def _rm(node: P2PNode, args: argparse.Namespace) -> int:
    manifest = node.registry.manifest(args.name, args.version)
    node.registry.delete(manifest.name, manifest.version)
    document = {"name": manifest.name, "version": manifest.version, "removed": True}
    _say(args, document, f"withdrew {manifest.name} version {manifest.version}")
    return 0


_ACTIONS = {"publish": _publish, "fetch": _fetch, "ls": _ls, "rm": _rm}


def _say(args: argparse.Namespace, document: dict[str, Any], text: str) -> None:
    print(json.dumps(document) if args.json else text, flush=True)


def _serve_until_stopped() -> None:
    stop = threading.Event()
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: stop.set())
    stop.wait()


def _size(count: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    unit = 0
    while count >= 1024 and unit < len(units) - 1:
        count, unit = count / 1024, unit + 1
    return f"{count:.1f} {units[unit]}"


class _Progress:
    """One line on the terminal, redrawn: bytes, share, holders, rate."""

    def __init__(self) -> None:
        self._started = time.monotonic()

    def __call__(self, stats: FetchStats) -> None:
        here = stats.fetched_bytes
        share = (stats.reused * 100 // stats.chunks if stats.chunks else 0) + (
            here * 100 // stats.total_bytes if stats.total_bytes else 0
        )
        rate = here / max(time.monotonic() - self._started, 1e-9)
        sys.stderr.write(
            f"\r{_size(here):>10} fetched, {min(share, 100):3d}%, {stats.holders} holders, "
            f"{_size(rate)}/s   "
        )
        sys.stderr.flush()

    def finish(self) -> None:
        sys.stderr.write("\n")
