"""Frozen, typed configuration, parsed once at the edge.

This is the only module of kvconnect that reads environment variables. Each component has one
dataclass; ``from_mapping`` builds it from JSON-like data and rejects unknown keys, ``from_env``
overlays ``KVCONNECT_<SECTION>_<FIELD>`` variables (and the shared ``KVCONNECT_TOKEN``,
``KVCONNECT_TOKEN_FILE`` and ``KVCONNECT_INSECURE``). :func:`cluster_token` resolves the cluster
token, generating one in a file only this user can read when none is configured.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import stat
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, TypeVar

from kvconnect.errors import ConfigError
from kvconnect.etcd import parse_url

KiB = 1024
MiB = 1024 * KiB

TransportName = Literal["auto", "local", "shm", "tcp", "rdma"]
NativeMode = Literal["auto", "on", "off"]

_C = TypeVar("_C")

log = logging.getLogger(__name__)

TOKEN_ENV = "KVCONNECT_TOKEN"  # noqa: S105 (a variable's name, not a secret)
TOKEN_FILE_ENV = "KVCONNECT_TOKEN_FILE"  # noqa: S105
_AUTH_ENV = {TOKEN_ENV: "token", TOKEN_FILE_ENV: "token_file", "KVCONNECT_INSECURE": "insecure"}

_SIZE_SUFFIX = {"K": KiB, "M": MiB, "G": MiB * 1024, "T": MiB * 1024 * 1024}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class _Section:
    """Parsing shared by the config classes: a mapping, or the environment."""

    __slots__ = ()
    _ENV_PREFIX: ClassVar[str]
    _SHARED_ENV: ClassVar[dict[str, str]] = {}  # variable → field, shared between sections

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Self:
        """Build from JSON-like data; unknown keys raise ConfigError listing the valid ones."""
        return _from_mapping(cls, data)

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        defaults: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> Self:
        """``defaults`` (e.g. from a file), then ``<prefix><FIELD>`` variables (and shared
        ones), then ``overrides``: later sources win."""
        env = os.environ if environ is None else environ
        values = _env_section(cls, env, cls._ENV_PREFIX)
        for variable, name in cls._SHARED_ENV.items():
            if variable in env and name not in values:
                values[name] = env[variable]
        return _from_mapping(cls, {**(defaults or {}), **values, **overrides})

    @classmethod
    def from_layers(
        cls, *layers: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> Self:
        """The environment, then each of ``layers`` in turn: later layers win (e.g. a file,
        then an engine's inline settings)."""
        env = os.environ if environ is None else environ
        merged = _env_section(cls, env, cls._ENV_PREFIX)
        for layer in layers:
            merged.update(layer)
        return _from_mapping(cls, merged)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferConfig(_Section):
    """Configuration of one :class:`~kvconnect.transfer.TransferEngine`."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_TRANSFER_"
    _SHARED_ENV: ClassVar[dict[str, str]] = _AUTH_ENV

    name: str | None = None
    """Segment name. Default: ``host:port`` of the listener (p2p, etcd) or a unique name
    (embedded). With p2p metadata it cannot be set."""
    listen_host: str = "127.0.0.1"
    """Interface the peer listener binds to; never widened behind the user's back."""
    listen_port: int = 0
    """TCP port of the peer listener; 0 picks a free one."""
    advertise_host: str | None = None
    """Address peers should dial; required when ``listen_host`` is a wildcard."""
    metadata: str = "p2p"
    """Where descriptors live: ``p2p`` asks the peer's listener, ``embedded`` is in-process,
    ``etcd://host:port[,host:port…]`` publishes them in etcd (needs the ``etcd`` extra)."""
    metadata_ttl: int = 5
    """Seconds of the etcd lease on this engine's descriptor (etcd metadata only): the
    descriptor of an engine that died without closing vanishes within about this long."""
    transport: TransportName = "auto"
    """``auto`` picks local → shm → rdma → tcp per peer; any other value forces that transport."""
    shm: bool = True
    """Offer same-host shared-memory access to regions from :meth:`TransferEngine.allocate`."""
    tcp_streams: int = 2
    """Parallel TCP connections per peer."""
    slice_bytes: int = 4 * MiB
    """Largest unit of work on a stream; bigger requests are split, smaller ones coalesced."""
    max_frame_entries: int = 256
    """Most requests coalesced into one frame."""
    stream_window: int = 4
    """Frames in flight per TCP stream (pipelining depth)."""
    copy_threads: int = 2
    """Threads doing same-host and same-process copies."""
    request_timeout: float = 30.0
    """Default deadline of a request, in seconds, when ``submit`` is given none."""
    connect_timeout: float = 5.0
    """Timeout for connecting to a peer and completing the handshake."""
    io_timeout: float = 10.0
    """A stream that moves no byte for this long is declared broken."""
    idle_timeout: float = 600.0
    """Connections idle this long are closed (listener) or retired (initiator)."""
    max_connections: int = 1024
    """Authenticated connections the listener serves at once; more are refused (one thread
    each)."""
    max_handshakes: int = 32
    """Connections the listener lets run their handshake at once, apart from
    ``max_connections``: one more closes the one that has been in its handshake longest, so
    clients that never finish (slowloris) can never lock authenticated peers out."""
    settle_grace: float = 1.0
    """Seconds ``TransferBatch.wait`` waits past the deadline for transport threads to let go
    of a request's memory; a request still held then is returned as PENDING."""
    max_frame_bytes: int = 256 * MiB
    """Largest payload of one frame the listener accepts; larger frames close the connection."""
    max_retries: int = 2
    """Times a frame is retried on another stream after a stream broke."""
    token: str | None = field(default=None, repr=False)
    """Cluster token: peers must prove it (HMAC challenge) before any data moves. Prefer
    ``token_file``; unset, :func:`cluster_token` finds or generates one."""
    token_file: str = ""
    """File holding the cluster token (first line); read when ``token`` is unset."""
    insecure: bool = False
    """Run without a token when none is configured (anyone who reaches the listener may read
    and write registered memory); otherwise a token is always used."""
    native: NativeMode = "auto"
    """C extension for the data path: ``auto`` when built, ``on`` requires it, ``off`` never."""
    rdma_nics: str = ""
    """Comma-separated RDMA devices the engine may use (e.g. ``mlx5_0,mlx5_1``); empty: all."""
    rdma_gid_index: int | None = None
    """GID table index of every NIC; None picks the RoCE v2 (IPv4-mapped) GID at run time."""
    rdma_qps_per_peer: int = 2
    """RC queue pairs per (local NIC, peer NIC) pair, for each peer engine."""
    rdma_slice_bytes: int = 1 * MiB
    """Largest RDMA work request; slices are cut into work requests of at most this size."""
    rdma_inline_bytes: int = 64
    """WRITEs up to this size go inline in the work request (no local DMA read); 0 disables."""

    def __post_init__(self) -> None:
        _check_positive(
            self,
            "tcp_streams",
            "slice_bytes",
            "max_frame_entries",
            "stream_window",
            "copy_threads",
            "request_timeout",
            "connect_timeout",
            "io_timeout",
            "idle_timeout",
            "max_connections",
            "max_handshakes",
            "settle_grace",
            "max_frame_bytes",
            "metadata_ttl",
            "rdma_qps_per_peer",
            "rdma_slice_bytes",
        )
        _check_metadata(self.metadata)
        if self.rdma_inline_bytes < 0:
            raise ConfigError(f"rdma_inline_bytes must be >= 0, got {self.rdma_inline_bytes}")
        if self.rdma_gid_index is not None and self.rdma_gid_index < 0:
            raise ConfigError(f"rdma_gid_index must be >= 0, got {self.rdma_gid_index}")
        if not 0 <= self.listen_port <= 65535:
            raise ConfigError(f"listen_port must be in 0..65535, got {self.listen_port}")
        if self.max_retries < 0:
            raise ConfigError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.max_frame_entries > 1000:
            raise ConfigError("max_frame_entries must be <= 1000 (the kernel's iovec limit)")
        if self.slice_bytes > self.max_frame_bytes:
            raise ConfigError("slice_bytes must not exceed max_frame_bytes")
        if self.listen_host in ("0.0.0.0", "::", "") and not self.advertise_host:  # noqa: S104
            raise ConfigError(
                f"listen_host {self.listen_host!r} is a wildcard: set advertise_host to the "
                "address peers should dial"
            )
        _check_token(self.token)

    def cluster_token(self) -> str | None:
        """The token this engine uses (see :func:`cluster_token`)."""
        return cluster_token(self.token, self.token_file, self.insecure)


@dataclass(frozen=True, slots=True, kw_only=True)
class MasterConfig(_Section):
    """Configuration of the store master (``kvconnect master``)."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_MASTER_"
    _SHARED_ENV: ClassVar[dict[str, str]] = _AUTH_ENV

    listen: str = "tcp://127.0.0.1:50051"
    """zmq endpoint the master answers on."""
    ha: str = ""
    """``etcd://host:port[,…]``: run as one of several masters, the elected one leads."""
    ha_ttl: int = 2
    """Seconds of the leader's etcd lease: a dead leader is replaced within about this long."""
    advertise: str = ""
    """Endpoint clients should dial (published in etcd); default: the bound endpoint."""
    metrics_port: int = 0
    """Prometheus metrics HTTP port on 127.0.0.1 (0: no metrics server)."""
    allocation: Literal["local_first", "random", "free_ratio"] = "local_first"
    """Placement strategy of new objects (docs/store.md)."""
    alignment: int = 64
    """Allocation granularity in bytes."""
    lease_ttl: float = 10.0
    """Seconds a read lease protects an object from eviction and removal."""
    put_timeout: float = 30.0
    """A put not completed within this many seconds is discarded."""
    quarantine: float = 60.0
    """Seconds the space of a discarded put stays unused (a late writer cannot hit new data)."""
    heartbeat_ttl: float = 10.0
    """A store server silent for this long loses its segments."""
    high_watermark: float = 0.95
    """Eviction starts above this fraction of capacity in use."""
    evict_fraction: float = 0.05
    """Eviction frees this fraction of capacity each time it starts."""
    eviction_step: int = 32
    """Objects evicted per step between requests (bounds the latency eviction adds)."""
    max_message_bytes: int = 128 * MiB
    """Largest request the master accepts; a peer sending more is disconnected."""
    token: str | None = field(default=None, repr=False)
    """Cluster token every RPC must be authenticated with (CURVE keys derived from it)."""
    token_file: str = ""
    """File holding the cluster token (first line); read when ``token`` is unset."""
    insecure: bool = False
    """Answer unauthenticated RPCs when no token is configured (anyone who reaches the port
    can mount, remove and read the topology); otherwise a token is always used."""

    def cluster_token(self) -> str | None:
        """The token RPCs are authenticated with (see :func:`cluster_token`)."""
        return cluster_token(self.token, self.token_file, self.insecure)

    def __post_init__(self) -> None:
        _check_positive(self, "alignment", "lease_ttl", "put_timeout", "heartbeat_ttl", "ha_ttl")
        if self.ha and not self.ha.startswith("etcd://"):
            raise ConfigError(f"ha must be an etcd://host:port URL, got {self.ha!r}")
        _check_positive(self, "evict_fraction", "eviction_step")
        if not 0 < self.high_watermark <= 1:
            raise ConfigError(f"high_watermark must be in (0, 1], got {self.high_watermark}")
        if self.alignment & (self.alignment - 1):
            raise ConfigError(f"alignment must be a power of two, got {self.alignment}")
        if self.quarantine < 0:
            raise ConfigError(f"quarantine must be >= 0, got {self.quarantine}")
        _check_positive(self, "max_message_bytes")
        _check_token(self.token)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreServerConfig(_Section):
    """Configuration of a store server (``kvconnect store``)."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_STORE_"

    master: str = "tcp://127.0.0.1:50051"
    """zmq endpoint of the master."""
    size: int = 1 << 30
    """Bytes of memory this server offers (allocated and pre-faulted at start)."""
    hugepages: bool = False
    """Back the memory with huge pages (needs vm.nr_hugepages)."""
    server_id: str = ""
    """Identity at the master; default: host name, pid and a random suffix."""
    heartbeat_interval: float = 0.5
    """Seconds between heartbeats. Each also acknowledges the master's journal, and released
    space is reused only once acknowledged, so this bounds how soon evicted space returns."""
    rpc_timeout: float = 2.0
    """Timeout of one call to the master."""
    metrics_port: int = 0
    """Prometheus metrics HTTP port on 127.0.0.1 (0: no metrics server)."""

    def __post_init__(self) -> None:
        _check_positive(self, "size", "heartbeat_interval", "rpc_timeout")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreClientConfig(_Section):
    """Configuration of the embedded store client (``StoreClient``)."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_CLIENT_"

    master: str = "tcp://127.0.0.1:50051"
    """zmq endpoint of the master."""
    rpc_timeout: float = 1.0
    """Timeout of one call to the master."""
    io_timeout: float = 5.0
    """Default deadline of a batch's data transfers."""
    replicas: int = 1
    """Copies of each object written (on distinct segments, best effort)."""
    breaker_failures: int = 3
    """Consecutive failures that open the circuit breaker."""
    breaker_cooldown: float = 5.0
    """Seconds the breaker stays open before one probe call."""
    negative_ttl: float = 10.0
    """Seconds a key whose read failed is reported as absent."""
    negative_entries: int = 100_000
    """Most keys remembered by the negative cache."""

    def __post_init__(self) -> None:
        _check_positive(self, "rpc_timeout", "io_timeout", "replicas", "breaker_failures")
        _check_positive(self, "breaker_cooldown", "negative_entries")
        if self.negative_ttl < 0:
            raise ConfigError(f"negative_ttl must be >= 0, got {self.negative_ttl}")


@dataclass(frozen=True, slots=True, kw_only=True)
class HiCacheConfig(_Section):
    """Configuration of the SGLang HiCache L3 backend (``kvconnect.sglang``), one per SGLang
    scheduler process (TP rank)."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_SGLANG_"

    master: str = "tcp://127.0.0.1:50051"
    """The store master: ``tcp://host:port``, or ``etcd://host:port[,…]`` with master HA."""
    config_file: str = ""
    """A JSON file with more of these settings (below the extra-config, above the
    environment)."""
    namespace: str = ""
    """Prefix of every key: separate caches (deployments, tenants) that share one store."""
    transport: TransportName = "auto"
    """Transfer transport to the store servers (``auto``: shared memory on the same host)."""
    listen_host: str = "127.0.0.1"
    """Interface of this process's transfer engine (matters with ``local_store_size``)."""
    read_timeout: float = 1.0
    """Deadline of one read of up to 128 pages: the pages that arrived by then, from the
    first on, are used and the rest is recomputed."""
    write_timeout: float = 5.0
    """Deadline of one write of up to 128 pages (the backup thread's)."""
    rpc_timeout: float = 0.5
    """Timeout of one call to the master."""
    breaker_failures: int = 3
    """Consecutive failures after which the backend runs local-only (no L3)."""
    breaker_cooldown: float = 2.0
    """Seconds of local-only operation before one probe of the store."""
    negative_ttl: float = 10.0
    """Seconds a page whose read failed is reported absent (no repeated timeouts on it)."""
    local_store_size: int = 0
    """Bytes of memory this host's SGLang engine adds to the store, shared evenly by its
    ranks on the host (each runs an embedded store server with its share); 0: none, engines
    then hold no store memory."""
    token_file: str = ""
    """File holding the cluster token (else ``KVCONNECT_TOKEN``, ``KVCONNECT_TOKEN_FILE``, the
    default token file); see the configuration reference."""
    insecure: bool = False
    """With no token configured, talk to an unauthenticated store instead of generating one."""

    def __post_init__(self) -> None:
        _check_positive(self, "read_timeout", "write_timeout", "rpc_timeout")
        _check_positive(self, "breaker_failures", "breaker_cooldown")
        if self.negative_ttl < 0 or self.local_store_size < 0:
            raise ConfigError("negative_ttl and local_store_size must be >= 0")
        if not self.master.startswith(("tcp://", "etcd://")):
            raise ConfigError(f"master must be tcp://host:port or etcd://…, got {self.master!r}")

    def cluster_token(self) -> str | None:
        """The token this backend authenticates with (see :func:`cluster_token`)."""
        return cluster_token(None, self.token_file, self.insecure)


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmConnectorConfig(_Section):
    """Configuration of the vLLM KV connector (``kvconnect.vllm``), from
    ``kv_connector_extra_config``; one per vLLM engine (scheduler and workers read the same)."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_VLLM_"

    config_file: str = ""
    """A JSON file with more of these settings (below the extra-config, above the
    environment)."""
    host: str = "127.0.0.1"
    """Address of this engine that peers reach: the prefill side channel binds it and the
    workers' transfer engines listen on it."""
    side_channel_port: int = 0
    """Port of the prefill side channel (handshakes, lease renewals, read confirmations);
    0 picks a free one (decode learns it from kv_transfer_params). Data-parallel rank ``i``
    uses ``port + i`` when set."""
    transport: TransportName = "auto"
    """Transfer transport between engines and to the store (``auto``: shm on one host)."""
    lease: float = 30.0
    """Seconds prefill keeps a finished request's blocks for decode; decode renews the lease
    while it waits, and prefill frees the blocks on its own once it lapses."""
    read_timeout: float = 10.0
    """Deadline of decode's read of one request's KV (then the load has failed)."""
    rpc_timeout: float = 2.0
    """Timeout of one side-channel call."""
    connect_timeout: float = 2.0
    """Timeout of the workers' transfer-engine connections to a peer (connect + handshake)."""
    enforce_compat: bool = True
    """Refuse to read KV whose layout, dtype or model differ from this engine's."""
    pool: bool = False
    """Share prefix blocks through the kvconnect store (look up, load, save)."""
    master: str = "tcp://127.0.0.1:50051"
    """The store master for the pool: ``tcp://host:port`` or ``etcd://host:port[,…]``."""
    namespace: str = ""
    """Prefix of every pool key: separate caches that share one store."""
    pool_read_timeout: float = 2.0
    """Deadline of one pool load; blocks not in by then are recomputed."""
    pool_write_timeout: float = 10.0
    """Deadline of one pool save (saves never hold up the forward pass)."""
    pool_rpc_timeout: float = 0.5
    """Timeout of one call to the store master (a lookup never waits longer)."""
    io_cpus: str = ""
    """CPUs for kvconnect's threads in this engine (transfers, side channel, pool), e.g.
    ``"30-31"``; empty: they inherit the CPUs of the thread that starts them (on vLLM's CPU
    workers, the cores vLLM bound this instance's model thread to)."""
    token_file: str = ""
    """File holding the cluster token that authenticates the side channel, the transfer
    engines and the pool (else ``KVCONNECT_TOKEN``, ``KVCONNECT_TOKEN_FILE``, the default
    token file); prefill and decode must share it."""
    insecure: bool = False
    """With no token configured, run unauthenticated instead of generating one."""

    def __post_init__(self) -> None:
        _check_positive(self, "lease", "read_timeout", "rpc_timeout", "connect_timeout")
        _check_positive(self, "pool_read_timeout", "pool_write_timeout", "pool_rpc_timeout")
        if not 0 <= self.side_channel_port < 65536:
            raise ConfigError(f"side_channel_port must be 0..65535, got {self.side_channel_port}")
        if not self.master.startswith(("tcp://", "etcd://")):
            raise ConfigError(f"master must be tcp://host:port or etcd://…, got {self.master!r}")
        parse_cpu_list(self.io_cpus)

    def cluster_token(self) -> str | None:
        """The token this connector authenticates with (see :func:`cluster_token`)."""
        return cluster_token(None, self.token_file, self.insecure)

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


_F = TypeVar("_F", HiCacheConfig, VllmConnectorConfig)


def engine_config(
    cls: type[_F], inline: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> _F:
    """An engine adapter's settings: ``inline`` (the engine's extra-config) wins over the JSON
    file named ``config_file`` (inline or in the environment), which wins over the
    environment. Raises ConfigError for unknown keys, bad values or an unreadable file."""
    path = inline.get("config_file") or cls.from_layers(environ=environ).config_file
    return cls.from_layers(_read_json_file(path), inline, environ=environ)


def _read_json_file(path: str) -> dict[str, Any]:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the kvconnect config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of settings")
    return data


def default_token_file(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CONFIG_HOME/kvconnect/token`` (``~/.config/kvconnect/token`` by default)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kvconnect" / "token"


def cluster_token(
    token: str | None,
    token_file: str,
    insecure: bool,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The cluster token: ``token``, else the file ``token_file``, else ``KVCONNECT_TOKEN``,
    else the file ``KVCONNECT_TOKEN_FILE``, else the default token file
    (:func:`default_token_file`). With none of them, ``insecure`` gives None; otherwise a new
    token is generated into the default file (mode 0600) so that processes of this user on
    this host share it, and other hosts must be given it. Raises ConfigError for an unreadable
    or empty file."""
    env = os.environ if environ is None else environ
    if token:
        return token
    path = token_file or env.get(TOKEN_FILE_ENV, "")
    if not path and env.get(TOKEN_ENV):
        return env[TOKEN_ENV]
    if path:
        return read_token_file(Path(path))
    default = default_token_file(env)
    if default.exists():
        return read_token_file(default)
    if insecure:
        return None
    return generate_token_file(default)


def read_token_file(path: Path) -> str:
    """The first line of ``path``; warns once when others may read the file."""
    try:
        text = path.read_text(encoding="utf-8")
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read the cluster token file {path}: {exc}") from exc
    token = text.strip().partition("\n")[0].strip()
    if not token:
        raise ConfigError(f"the cluster token file {path} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and path not in _WARNED:
        _WARNED.add(path)
        log.warning("cluster token file %s is readable by other users: chmod 600 it", path)
    return token


_WARNED: set[Path] = set()


def generate_token_file(path: Path) -> str:
    """Write a new random token to ``path`` (mode 0600; kept if another process was first)."""
    token = secrets.token_urlsafe(32)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token_file(path)
    except OSError as exc:
        raise ConfigError(
            f"no cluster token is configured and none could be generated at {path}: {exc}; "
            f"set {TOKEN_ENV} or {TOKEN_FILE_ENV} (or insecure to run without one)"
        ) from exc
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(token + "\n")
    log.warning("generated a cluster token in %s (give it to the other hosts)", path)
    return token


def _check_token(token: str | None) -> None:
    if token is not None and not token:
        raise ConfigError("token must be a non-empty string or None")


def _check_metadata(metadata: str) -> None:
    if metadata in ("p2p", "embedded"):
        return
    if not metadata.startswith("etcd://"):
        raise ConfigError(
            "metadata must be p2p, embedded or an etcd://host:port[,host:port] URL; "
            f"got {metadata!r}"
        )
    parse_url(metadata)  # ConfigError naming the bad endpoint


def _check_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value!r}")


def _env_section(cls: type, env: Mapping[str, str], prefix: str) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :].lower()
        if name not in known:
            raise ConfigError(
                f"unknown environment variable {key}; valid: "
                + ", ".join(prefix + n.upper() for n in sorted(known))
            )
        values[name] = raw
    return values


def _from_mapping(cls: type[_C], data: Mapping[str, Any]) -> _C:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
        )
    kwargs = {name: _coerce(name, value, hints[name]) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Convert strings from the environment and check JSON values against the field's type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("", "none"))
        if is_none and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{name} must be one of {', '.join(map(str, args))}; got {value!r}")
        return value
    if hint is bool:
        return _coerce_bool(name, value)
    if hint in (int, float):
        return _coerce_number(name, value, hint)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return value
    return value


def _coerce_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ConfigError(f"{name} must be a boolean, got {value!r}")


def _coerce_number(name: str, value: Any, kind: type) -> int | float:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if isinstance(value, int | float) and (kind is float or isinstance(value, int)):
        return kind(value)  # type: ignore[no-any-return]
    if isinstance(value, str):
        text = value.strip()
        scale = _SIZE_SUFFIX.get(text[-1:].upper(), 1) if kind is int else 1
        try:
            return kind(text[:-1] if scale > 1 else text) * scale  # type: ignore[no-any-return]
        except ValueError:
            pass
    raise ConfigError(
        f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
    )


__all__ = [
    "KiB",
    "MasterConfig",
    "MiB",
    "StoreClientConfig",
    "StoreServerConfig",
    "TransferConfig",
]
