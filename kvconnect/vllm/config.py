"""The connector's settings, parsed once, from vLLM's ``kv_connector_extra_config``.

Precedence, highest first: the extra-config, then the JSON file it (or the environment) names
as ``config_file``, then ``KVCONNECT_VLLM_*`` environment variables (and, for the embedded
sections, ``KVCONNECT_CLIENT_*`` and ``KVCONNECT_TRANSFER_*`` below those). Unknown keys are
errors that list the valid ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvconnect._config import (
    Composed,
    Route,
    check_positive,
    cluster_token,
    embedded_default,
    layered,
)
from kvconnect.errors import ConfigError
from kvconnect.p2p.config import P2PConfig
from kvconnect.store.config import StoreClientConfig
from kvconnect.transfer.config import TransferConfig

_ROUTES = {
    "host": Route("transfer", "listen_host", "127.0.0.1"),
    "transport": Route("transfer", "transport", "auto"),
    "connect_timeout": Route("transfer", "connect_timeout", 2.0),
    "master": Route("store", "master", "tcp://127.0.0.1:50051"),
    "pool_rpc_timeout": Route("store", "rpc_timeout", 0.5),
}
"""The flat keys of the connector that set fields of its embedded sections.

``host`` is the address of this engine that peers reach: the prefill side channel binds it
and the transfer engines listen on it; ``transport`` the transfer transport between engines
and to the store (``auto``: shm on one host); ``connect_timeout`` the timeout of the transfer
engines' connections to a peer (connect + handshake); ``master`` the store master for the
pool (``tcp://host:port`` or ``etcd://host:port[,…]``); ``pool_rpc_timeout`` the timeout of
one call to the store master (a lookup never waits longer)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmConnectorConfig(Composed):
    """Configuration of the vLLM KV connector (``kvconnect.vllm``), from
    ``kv_connector_extra_config``; one per vLLM engine (scheduler and workers read the same).
    Embeds the pool's store-client section and the transfer engines' section; the flat keys
    of ``_ROUTES`` set fields of those."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_VLLM_"
    _ROUTES: ClassVar[Mapping[str, Route]] = _ROUTES

    store: StoreClientConfig = field(
        default_factory=embedded_default(StoreClientConfig, _ROUTES, "store")
    )
    """The pool's store client (every :class:`StoreClientConfig` key, e.g. ``replicas``)."""
    transfer: TransferConfig = field(
        default_factory=embedded_default(TransferConfig, _ROUTES, "transfer")
    )
    """The transfer engines (the workers', and the scheduler's for the pool); their token is
    this section's (below)."""
    config_file: str = ""
    """A JSON file with more of these settings (below the extra-config, above the
    environment)."""
    side_channel_port: int = 0
    """Port of the prefill side channel (handshakes, lease renewals, read confirmations);
    0 picks a free one (decode learns it from kv_transfer_params). Data-parallel rank ``i``
    uses ``port + i`` when set."""
    lease: float = 30.0
    """Seconds prefill keeps a finished request's blocks for decode; decode renews the lease
    while it waits, and prefill frees the blocks on its own once it lapses."""
    read_timeout: float = 10.0
    """Deadline of decode's read of one request's KV (then the load has failed)."""
    rpc_timeout: float = 2.0
    """Timeout of one side-channel call."""
    enforce_compat: bool = True
    """Refuse to read KV whose layout, dtype or model differ from this engine's."""
    pool: bool = False
    """Share prefix blocks through the kvconnect store (look up, load, save)."""
    namespace: str = ""
    """Prefix of every pool key: separate caches that share one store."""
    pool_read_timeout: float = 2.0
    """Deadline of one pool load; blocks not in by then are recomputed."""
    pool_write_timeout: float = 10.0
    """Deadline of one pool save (saves never hold up the forward pass)."""
    pool_save_generated: bool = False
    """Also save the full blocks of a finished request's output (multi-turn chats resend it
    as the next prompt); its blocks stay allocated until that save is done."""
    events_poll_interval: float = 1.0
    """Seconds between the pool's polls of the store master for removed blocks (its
    ``BlockRemoved`` KV events; only while vLLM publishes KV events)."""
    io_cpus: str = ""
    """CPUs for kvconnect's threads in this engine (transfers, side channel, pool), e.g.
    ``"30-31"``; empty: they inherit the CPUs of the thread that starts them (on vLLM's CPU
    workers, the cores vLLM bound this instance's model thread to)."""
    idle_wait: float = 0.002
    """Seconds an idle step (vLLM scheduled no tokens) waits, while this worker reads or loads
    KV or holds blocks (for decode, or a save), before vLLM steps again; a transfer that
    reports ends the wait at once. vLLM's worker otherwise polls for its next step nearly
    without pause and takes the CPU and the GIL from the transfer threads (docs/vllm.md,
    "Where a read's time goes"); it delays a new request by at most this. 0: never wait."""
    gil_switch_interval: float = 0.0002
    """Seconds a thread of vLLM's worker process holds the GIL while another waits for it
    (``sys.setswitchinterval``, lowered to this at start, never raised; 0: leave Python's
    5 ms). vLLM's worker runs Python nearly without pause while a request waits for its KV,
    and each time a transfer thread's socket call returns it waits for the GIL (docs/vllm.md,
    "Where a read's time goes")."""
    token_file: str = ""
    """File holding the cluster token that authenticates the side channel, the transfer
    engines and the pool (else ``KVCONNECT_TOKEN``, ``KVCONNECT_TOKEN_FILE``, the default
    token file); prefill and decode must share it."""
    insecure: bool = False
    """With no token configured, run unauthenticated instead of generating one."""

    def __post_init__(self) -> None:
        check_positive(self, "lease", "read_timeout", "rpc_timeout")
        check_positive(self, "pool_read_timeout", "pool_write_timeout", "events_poll_interval")
        if not 0 <= self.side_channel_port < 65536:
            raise ConfigError(f"side_channel_port must be 0..65535, got {self.side_channel_port}")
        if not self.store.master.startswith(("tcp://", "etcd://")):
            raise ConfigError(
                f"master must be tcp://host:port or etcd://…, got {self.store.master!r}"
            )
        parse_cpu_list(self.io_cpus)
        if not 0 <= self.idle_wait <= 0.05:
            raise ConfigError(f"idle_wait must be 0..0.05 seconds, got {self.idle_wait}")
        if not 0 <= self.gil_switch_interval <= 0.005:
            raise ConfigError(
                f"gil_switch_interval must be 0..0.005 seconds, got {self.gil_switch_interval}"
            )

    @property
    def host(self) -> str:
        """The address peers reach this engine at (``transfer.listen_host``)."""
        return self.transfer.listen_host

    def cluster_token(self) -> str | None:
        """The token this connector authenticates with (see :func:`cluster_token`)."""
        return cluster_token(None, self.token_file, self.insecure)

    def transfer_config(self, token: str | None) -> TransferConfig:
        """The transfer engines' section with the cluster ``token`` (None: insecure)."""
        return self.transfer.replace(token=token, insecure=token is None)

    @property
    def io_cpu_set(self) -> frozenset[int]:
        """``io_cpus`` as a set (empty: inherit)."""
        return parse_cpu_list(self.io_cpus)


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` → ``{0, 1, 2, 3, 8, 10, 11}`` (Linux's CPU-list format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part.strip():
            continue
        first, _, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            low = high = -1
        if low < 0 or high < low:
            raise ConfigError(f"bad CPU list {text!r}: {part!r} is not N or N-M")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def parse_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> VllmConnectorConfig:
    """The connector's configuration; raises ConfigError for unknown keys or bad values."""
    return layered(VllmConnectorConfig, dict(extra or {}), environ)


_LOADER_ROUTES = {
    "etcd": Route("p2p", "etcd", "etcd://127.0.0.1:2379"),
    "listen_host": Route("p2p", "listen_host", "127.0.0.1"),
    "advertise_host": Route("p2p", "advertise_host", None),
    "token_file": Route("p2p", "token_file", ""),
    "locality": Route("p2p", "locality", ""),
}
"""The flat keys of the loader that set fields of its P2P node's section: the swarm's etcd,
the address the node serves chunks on (and the one peers dial), the token file, its place."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderConfig(Composed):
    """Configuration of ``--load-format kvconnect`` (``kvconnect.vllm.loader``), from vLLM's
    ``--model-loader-extra-config``: which object of the P2P store holds the checkpoint's
    weights, where they land, and what happens when the swarm cannot deliver them."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_VLLM_LOADER_"
    _ROUTES: ClassVar[Mapping[str, Route]] = _LOADER_ROUTES

    p2p: P2PConfig = field(default_factory=embedded_default(P2PConfig, _LOADER_ROUTES, "p2p"))
    """The P2P node of the worker (every :class:`~kvconnect.p2p.P2PConfig` key)."""
    config_file: str = ""
    """A JSON file with more of these settings (below the extra-config)."""
    name: str = ""
    """The object in the P2P store (``kvconnect p2p publish DIR --name NAME``); required."""
    version: str = ""
    """Its version; empty: the latest."""
    cache_dir: str = ""
    """Where the object's files land (kept: a restart verifies them and fetches nothing);
    empty: ``~/.cache/kvconnect/p2p/NAME``."""
    timeout: float = 600.0
    """Seconds the fetch may take before the load falls back (or fails)."""
    fallback: bool = True
    """When the swarm cannot deliver (etcd unreachable, unknown object, timeout), load the
    model's own local files as ``--load-format safetensors`` would; ``False``: fail."""
    seed: bool = True
    """Keep serving the fetched weights to other instances until this process exits."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("--load-format kvconnect needs 'name' (the P2P store object)")
        check_positive(self, "timeout")

    def target(self) -> Path:
        """The directory the object lands in."""
        if self.cache_dir:
            return Path(self.cache_dir)
        return Path.home() / ".cache" / "kvconnect" / "p2p" / self.name


def parse_loader_config(extra: object, environ: Mapping[str, str] | None = None) -> LoaderConfig:
    """The loader's configuration from ``--model-loader-extra-config`` (a JSON object);
    raises ConfigError for another value, unknown keys or bad values."""
    if not isinstance(extra, Mapping):
        raise ConfigError(f"--model-loader-extra-config must be a JSON object, got {extra!r}")
    return layered(LoaderConfig, dict(extra), environ)
