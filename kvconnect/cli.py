"""The ``kvconnect`` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (subcommands register their own options)."""
    from kvconnect import __version__
    from kvconnect.bench import transfer as bench_transfer

    parser = argparse.ArgumentParser(
        prog="kvconnect", description="Move and share LLM KV cache across processes and machines."
    )
    parser.add_argument("--version", action="version", version=f"kvconnect {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="benchmarks with same-run baselines")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    transfer = benches.add_parser(
        "transfer", help="transfer engine throughput between two processes"
    )
    bench_transfer.add_arguments(transfer)
    transfer.set_defaults(handler=bench_transfer.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    status: int = args.handler(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
