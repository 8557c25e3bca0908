"""The ``kvconnect`` command.

Configuration of every long-running command comes, lowest precedence first, from a JSON file
(``--config``: sections ``transfer``, ``master``, ``store``, ``client``), the environment
(``KVCONNECT_<SECTION>_<FIELD>``), and flags (one per field, e.g. ``--master-lease-ttl 5``).
``--token-file`` and ``--insecure`` set the cluster token of every section at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvconnect._config import cluster_token, tenant_token
from kvconnect.errors import ConfigError
from kvconnect.store.config import (
    MasterConfig,
    PeerConfig,
    StoreClientConfig,
    StoreServerConfig,
    TenantConfig,
)
from kvconnect.transfer import TransferConfig

log = logging.getLogger("kvconnect")

_C = TypeVar("_C", TransferConfig, MasterConfig, StoreServerConfig, StoreClientConfig)
_SECTIONS: dict[str, type] = {
    "transfer": TransferConfig,
    "master": MasterConfig,
    "store": StoreServerConfig,
    "client": StoreClientConfig,
}


class _LazyParser(argparse.ArgumentParser):
    """A subcommand's parser whose options and handler come from the module ``declare`` names
    (its ``add_arguments(parser)`` and ``run(args) -> int``), imported only when that subcommand
    is parsed: ``kvconnect master`` never imports the demo or the benchmarks."""

    def __init__(self, *args: Any, declare: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._declare = declare

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:
        """Declare the module's options first (once), then parse as argparse does."""
        if self._declare is not None:
            module = importlib.import_module(self._declare)
            self._declare = None
            module.add_arguments(self)
            self.set_defaults(handler=module.run)
        return super().parse_known_args(*args, **kwargs)


# Benchmarks: name, help, module (``kvconnect bench NAME`` runs the module's ``run``).
_BENCHES = (
    ("transfer", "transfer engine throughput between two processes", "kvconnect.bench.transfer"),
    ("failover", "master failover time with etcd HA", "kvconnect.bench.failover"),
    ("store", "store data path, lookups and master scale", "kvconnect.bench.store"),
    (
        "pool-load",
        "master load of the vLLM pool per block: old vs new keys",
        "kvconnect.bench.pool_load",
    ),
    ("vllm", "vLLM prefill/decode: kvconnect vs NIXL", "kvconnect.bench.vllm_pd"),
    ("vllm-pool", "vLLM shared pool: TTFT of a second instance", "kvconnect.bench.vllm_pool"),
    ("sglang", "SGLang HiCache L3: kvconnect vs mooncake and file", "kvconnect.bench.sglang"),
    ("router", "kvconnect router: cache-aware vs round-robin vs random", "kvconnect.bench.router"),
    (
        "federation",
        "two store clusters sharing prefixes: federated vs isolated, peer faults",
        "kvconnect.bench.federation",
    ),
    ("p2p", "P2P store: a checkpoint to N peers, swarm vs one source", "kvconnect.bench.p2p"),
    (
        "vllm-coldstart",
        "vLLM cold start: weights from the P2P store vs local disk vs one HTTP source",
        "kvconnect.bench.vllm_coldstart",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser. Building it imports no command's module: the demo's and each
    benchmark's options are declared when that command is parsed (:class:`_LazyParser`)."""
    from kvconnect import __version__

    parser = argparse.ArgumentParser(
        prog="kvconnect", description="Move and share LLM KV cache across processes and machines."
    )
    parser.add_argument("--version", action="version", version=f"kvconnect {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_LazyParser
    )

    master = commands.add_parser("master", help="run a store master (metadata only)")
    master.add_argument(
        "--ha", dest="master__ha", metavar="ETCD_URL", help="same as --master-ha: join an HA group"
    )
    _config_flags(master, "master")
    master.set_defaults(handler=_master)

    store = commands.add_parser("store", help="run a store server (owns memory)")
    _config_flags(store, "store", "transfer")
    store.set_defaults(handler=_store)

    serve = commands.add_parser("serve", help="run a master and one store server, all in one")
    _config_flags(serve, "master", "store", "transfer")
    serve.set_defaults(handler=_serve)

    commands.add_parser(
        "demo",
        help="an all-in-one store with client processes sharing KV pages",
        declare="kvconnect.store.demo",
    )

    commands.add_parser(
        "router",
        help="a cache-aware, load-aware router in front of a vLLM PD fleet",
        declare="kvconnect.router.command",
    )

    commands.add_parser(
        "p2p",
        help="the P2P store: publish, fetch and list large objects (model weights)",
        declare="kvconnect.p2p.command",
    )

    status = commands.add_parser("status", help="print the store cluster: segments, usage, keys")
    status.add_argument("--master", default=StoreClientConfig().master, help="master endpoint")
    status.add_argument("--timeout", type=float, default=2.0)
    status.add_argument(
        "--peers",
        metavar="FILE",
        help="JSON file with a client's peer clusters (a list, or a mapping with 'peers'): "
        "also show whether each answers",
    )
    _auth_flags(status)
    status.set_defaults(handler=_status)

    tenant = commands.add_parser(
        "tenant-token", help="print a tenant's token, derived from the cluster token"
    )
    tenant.add_argument("name", help="the tenant (as in the master's tenants)")
    _auth_flags(tenant)
    tenant.set_defaults(handler=_tenant_token)

    topology = commands.add_parser(
        "topology", help="print RDMA NICs and GPUs with their PCIe/NUMA distances"
    )
    topology.add_argument("--sysfs", default="/sys", help="sysfs root (default /sys)")
    topology.set_defaults(handler=_topology)

    bench = commands.add_parser("bench", help="benchmarks with same-run baselines")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, summary, module in _BENCHES:
        benches.add_parser(name, help=summary, declare=module)
    return parser


def _auth_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help="file with the cluster token (default: KVCONNECT_TOKEN, KVCONNECT_TOKEN_FILE, "
        "then ~/.config/kvconnect/token, generated there if absent)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="without a configured token, run unauthenticated (anyone who reaches the ports "
        "may use them)",
    )


def _config_flags(parser: argparse.ArgumentParser, *sections: str) -> None:
    parser.add_argument("--config", help="JSON file with sections " + ", ".join(sections))
    _auth_flags(parser)
    for section in sections:
        group = parser.add_argument_group(f"{section} options")
        for field in dataclasses.fields(_SECTIONS[section]):
            flag = f"--{section}-{field.name.replace('_', '-')}"
            group.add_argument(flag, dest=f"{section}__{field.name}", metavar="VALUE")


def section_config(args: argparse.Namespace, section: str, cls: type[_C]) -> _C:
    """File, then environment, then flags: the config of one section."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        with open(args.config, encoding="utf-8") as handle:
            document = json.load(handle)
        unknown = sorted(set(document) - set(_SECTIONS))
        if unknown:
            raise ConfigError(f"unknown section(s) {', '.join(unknown)} in {args.config}")
        values.update(document.get(section, {}))
    prefix = f"{section}__"
    flags = {
        name[len(prefix) :]: value
        for name, value in vars(args).items()
        if name.startswith(prefix) and value is not None
    }
    if "token" in flags:
        log.warning("--%s-token is visible to every local user (ps): prefer --token-file", section)
    if cls in (TransferConfig, MasterConfig):
        if getattr(args, "token_file", None):
            flags["token_file"] = args.token_file
            flags.setdefault("token", None)  # the flag wins over KVCONNECT_TOKEN
        if getattr(args, "insecure", False):
            flags["insecure"] = True
    return cls.from_env(defaults=values, **flags)


def _master(args: argparse.Namespace) -> int:
    from kvconnect.store.commands import run_master

    return run_master(section_config(args, "master", MasterConfig))


def _store(args: argparse.Namespace) -> int:
    from kvconnect.store.commands import run_store

    return run_store(
        section_config(args, "store", StoreServerConfig),
        section_config(args, "transfer", TransferConfig),
    )


def _serve(args: argparse.Namespace) -> int:
    from kvconnect.store.commands import run_serve

    return run_serve(
        section_config(args, "master", MasterConfig),
        section_config(args, "store", StoreServerConfig),
        section_config(args, "transfer", TransferConfig),
    )


def _status(args: argparse.Namespace) -> int:
    from kvconnect.store.commands import run_status

    token = cluster_token(None, args.token_file or "", args.insecure)
    return run_status(args.master, args.timeout, token, _peers_file(args.peers, args.master))


def _peers_file(path: str | None, home: str) -> tuple[PeerConfig, ...]:
    """The peer clusters of home ``home`` in ``path`` (ConfigError if it cannot be read or
    parsed)."""
    if not path:
        return ()
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read peers from {path}: {exc}") from exc
    if isinstance(document, dict):
        document = document.get("peers", [])
    return StoreClientConfig.from_mapping({"master": home, "peers": document}).peers


def _tenant_token(args: argparse.Namespace) -> int:
    token = cluster_token(None, args.token_file or "", args.insecure)
    if token is None:
        raise ConfigError("tenants need a cluster token (their tokens derive from it)")
    print(tenant_token(token, TenantConfig(name=args.name).name))
    return 0


def _topology(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvconnect.transfer.transports.rdma import topology

    root = Path(args.sysfs)
    print(topology.matrix(topology.discover_nics(root), topology.discover_gpus(root)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        status: int = args.handler(args)
    except ConfigError as exc:
        print(f"kvconnect: configuration error: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
