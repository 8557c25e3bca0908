"""The store's sections of the configuration: the master, the store server and the embedded
client (machinery in ``kvconnect._config``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

from kvconnect._config import (
    AUTH_ENV,
    MiB,
    Section,
    check_choice,
    check_nonnegative,
    check_positive,
    check_token,
    cluster_token,
)
from kvconnect.errors import ConfigError
from kvconnect.store.messages import MAX_PEERS
from kvconnect.transfer.config import NativeMode


class Strategy(enum.StrEnum):
    """Where new objects go (``MasterConfig.allocation``; docs/store.md and
    :mod:`kvconnect.store.master.segments` describe each)."""

    LOCAL_FIRST = "local_first"
    RANDOM = "random"
    FREE_RATIO = "free_ratio"


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantConfig(Section):
    """A tenant of the store (an item of ``MasterConfig.tenants``; docs/store.md,
    "Tenants"): a namespace of keys of its own, a quota, and a token derived from the
    cluster token (``kvconnect tenant-token NAME``)."""

    name: str = ""
    """Letters, digits, ``-`` and ``_``, at most 32 bytes; unique among the tenants."""
    quota: int = 0
    """Bytes the tenant may keep in memory (objects and puts under way; 0: no quota). A put
    over it is NO_SPACE and evicts the tenant's own least recently used objects from memory
    (to disk where a disk tier takes them), never another's."""
    disk_quota: int = 0
    """Bytes the tenant may keep on disk (0: no quota): beyond it, its oldest objects on disk
    are dropped."""
    share: int = 0
    """Bytes of memory the tenant is entitled to when the store is full (0: its quota):
    eviction takes from the tenants over their share first."""

    def __post_init__(self) -> None:
        if not _is_name(self.name) or len(self.name) > 32:
            raise ConfigError(
                f"a tenant needs a name of letters, digits, - and _, got {self.name!r}"
            )
        if min(self.quota, self.disk_quota, self.share) < 0:
            raise ConfigError(f"tenant {self.name}: quotas and share must be >= 0")


def _is_name(text: str) -> bool:
    return bool(text) and text.isascii() and text.replace("-", "").replace("_", "").isalnum()


@dataclass(frozen=True, slots=True, kw_only=True)
class MasterConfig(Section):
    """Configuration of the store master (``kvconnect master``)."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_MASTER_"
    _SHARED_ENV: ClassVar[dict[str, str]] = AUTH_ENV

    listen: str = "tcp://127.0.0.1:50051"
    """``tcp://host:port`` the master answers on (``*`` for every address)."""
    ha: str = ""
    """``etcd://host:port[,…]``: run as one of several masters, the elected one leads."""
    ha_ttl: int = 2
    """Seconds of the leader's etcd lease: a dead leader is replaced within about this long."""
    advertise: str = ""
    """Endpoint clients should dial (published in etcd); default: the bound endpoint."""
    metrics_port: int = 0
    """Prometheus metrics HTTP port on 127.0.0.1 (0: no metrics server)."""
    allocation: Strategy = Strategy.LOCAL_FIRST
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
    demotion_inflight: int = 256 * MiB
    """Bytes of demotions under way into one disk segment at most; DRAM eviction beyond it
    drops objects instead of demoting them (0: never demote)."""
    promote_window: float = 30.0
    """A disk-only object read again within this many seconds is copied back into free DRAM
    of its server (0: never promote)."""
    max_message_bytes: int = 128 * MiB
    """Largest request the master accepts; a peer sending more is disconnected."""
    poll_window: float = 200e-6
    """Seconds the master polls for the next request after answering one before it sleeps
    (0: sleep at once): a request that follows soon (a put's second half, a busy client's
    next call) is answered without a wake-up, for up to this much CPU per idle gap. Not after
    an answer that starts a transfer of more than 1 MiB (docs/architecture.md, "Polling
    windows")."""
    kv_events: str = ""
    """zmq endpoint to bind a PUB socket at, publishing what the store holds as vLLM KV
    events (``BlockStored``/``BlockRemoved``; docs/store.md); empty: no events."""
    kv_events_replay: str = ""
    """zmq endpoint to bind the events' replay ROUTER at (empty: no replay)."""
    kv_events_buffer: int = 10_000
    """Batches of events kept for replay."""
    native: NativeMode = NativeMode.AUTO
    """The key index: the C table when built (``auto``), required (``on``), the Python dict
    (``off``)."""
    token: str | None = field(default=None, repr=False)
    """Cluster token every RPC must be authenticated with (the channel is sealed with keys
    derived from it)."""
    token_file: str = ""
    """File holding the cluster token (first line); read when ``token`` is unset."""
    insecure: bool = False
    """Answer unauthenticated RPCs when no token is configured (anyone who reaches the port
    can mount, remove and read the topology); otherwise a token is always used."""
    tenants: tuple[TenantConfig, ...] = ()
    """Tenants (docs/store.md, "Tenants"): a list of :class:`TenantConfig` mappings (JSON text
    in the environment and on flags). A client proving a tenant's token is that tenant."""

    def cluster_token(self) -> str | None:
        """The token RPCs are authenticated with (see :func:`cluster_token`)."""
        return cluster_token(self.token, self.token_file, self.insecure)

    def __post_init__(self) -> None:
        check_choice(self, "allocation", Strategy)
        check_choice(self, "native", NativeMode)
        check_positive(self, "alignment", "lease_ttl", "put_timeout", "heartbeat_ttl", "ha_ttl")
        if self.ha and not self.ha.startswith("etcd://"):
            raise ConfigError(f"ha must be an etcd://host:port URL, got {self.ha!r}")
        check_positive(self, "evict_fraction", "eviction_step")
        if not 0 < self.high_watermark <= 1:
            raise ConfigError(f"high_watermark must be in (0, 1], got {self.high_watermark}")
        if self.alignment & (self.alignment - 1):
            raise ConfigError(f"alignment must be a power of two, got {self.alignment}")
        if self.quarantine < 0:
            raise ConfigError(f"quarantine must be >= 0, got {self.quarantine}")
        check_positive(self, "max_message_bytes")
        check_nonnegative(self, "poll_window")
        if self.demotion_inflight < 0 or self.promote_window < 0:
            raise ConfigError("demotion_inflight and promote_window must be >= 0")
        check_token(self.token)
        check_positive(self, "kv_events_buffer")
        if self.kv_events_replay and not self.kv_events:
            raise ConfigError("kv_events_replay needs kv_events (the events' PUB endpoint)")
        names = [tenant.name for tenant in self.tenants]
        if len(set(names)) != len(names):
            raise ConfigError(f"tenant names must be unique, got {names}")
        if self.tenants and self.insecure and not self.token and not self.token_file:
            raise ConfigError("tenants need a cluster token (their tokens derive from it)")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreServerConfig(Section):
    """Configuration of a store server (``kvconnect store``)."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_STORE_"

    master: str = "tcp://127.0.0.1:50051"
    """``tcp://host:port`` of the master (or ``etcd://…`` to follow the HA leader)."""
    size: int = 1 << 30
    """Bytes of memory this server offers (allocated and pre-faulted at start)."""
    hugepages: bool = False
    """Back the memory with huge pages (needs vm.nr_hugepages)."""
    server_id: str = ""
    """Identity at the master, unique in the cluster; when set it also names this server's
    segments, so a restart replaces the old mounts and finds its disks again. Default: host
    name, pid and a random suffix."""
    heartbeat_interval: float = 0.5
    """Seconds between heartbeats. Each also acknowledges the master's journal, and released
    space is reused only once acknowledged, so this bounds how soon evicted space returns."""
    rpc_timeout: float = 2.0
    """Timeout of one call to the master."""
    metrics_port: int = 0
    """Prometheus metrics HTTP port on 127.0.0.1 (0: no metrics server)."""
    disk: str = ""
    """``PATH[,PATH…]``: a disk tier under the memory, one per path (a file, or a directory
    in which the server keeps ``kvconnect-<server_id>.data`` and its index). Objects the memory
    evicts are written there and read back from there; they survive a restart with the same
    ``server_id``."""
    disk_size: int = 0
    """Bytes of disk offered in all, split evenly between the ``disk`` paths (preallocated)."""
    disk_queue: int = 64 * MiB
    """Bytes of evicted objects waiting to be written (per disk); a demotion that finds the
    queue full is dropped, as an eviction without a disk would be."""
    disk_timeout: float = 10.0
    """A disk operation that takes longer than this takes the disk out of service."""

    def __post_init__(self) -> None:
        check_positive(self, "size", "heartbeat_interval", "rpc_timeout")
        check_positive(self, "disk_queue", "disk_timeout")
        if bool(self.disk) != (self.disk_size > 0):
            raise ConfigError("disk and disk_size go together: set both or neither")
        if self.disk_size and self.disk_size < len(self.disk_paths()) * MiB:
            raise ConfigError(f"disk_size must give each disk at least 1 MiB, got {self.disk_size}")

    def disk_paths(self) -> list[str]:
        """The ``disk`` paths, in order."""
        return [path.strip() for path in self.disk.split(",") if path.strip()]


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerConfig(Section):
    """A peer cluster a store client reads the keys its home cluster misses from
    (an item of ``StoreClientConfig.peers``, never set from variables of its own;
    docs/store.md, "Federation")."""

    name: str = ""
    """Short name (status, metrics, logs); unique among a client's peers."""
    master: str = ""
    """``tcp://host:port`` of the peer's master, or ``etcd://…`` to follow its HA leader."""
    token: str | None = field(default=None, repr=False)
    """The peer cluster's token (its master's RPCs and its store servers' data). Prefer
    ``token_file``; with neither, the default token file (the home cluster's default)."""
    token_file: str = ""
    """File holding the peer's token (first line)."""
    insecure: bool = False
    """The peer runs without a token (see ``StoreClientConfig``'s engine)."""
    metadata: str = "p2p"
    """Where the peer's store servers publish their segments (``TransferConfig.metadata``)."""
    share: float = 0.5
    """Fraction of a call's remaining deadline the peer's lookup and read may take."""
    rpc_timeout: float = 0.2
    """Timeout of one call to the peer's master: the bounded attempt a dead, stopped or
    partitioned peer costs before it is skipped."""
    probe_interval: float = 1.0
    """Seconds between two probes of a peer that failed (probes run on a background
    thread: callers skip a failed peer until a probe finds it back)."""
    negative_ttl: float = 2.0
    """Seconds a key the peer did not have is not asked for again (0: always ask)."""
    negative_entries: int = 100_000
    """Most keys the peer's negative cache remembers."""
    copy_home: bool = False
    """Copy each key read from this peer into the home cluster, in the background, so the
    next reader finds it at home."""
    copy_writes: bool = False
    """Copy each key this client writes home into this peer as well, in the background (read
    back from home, written with the peer's token: the peer's master places it, its quotas
    and eviction apply), so readers of the peer's group find it there."""
    copy_queue: int = 1024
    """Keys waiting to be copied (either way) at most; more are not copied."""

    def cluster_token(self) -> str | None:
        """The peer's token (see :func:`cluster_token`)."""
        return cluster_token(self.token, self.token_file, self.insecure)

    def __post_init__(self) -> None:
        if not _is_name(self.name) or len(self.name) > 64:
            raise ConfigError(
                f"a peer needs a name of letters, digits, - and _ (at most 64), got {self.name!r}"
            )
        if len(self.master.encode()) > 256:
            raise ConfigError(f"peer {self.name}: master longer than 256 bytes")
        if not self.master.startswith(("tcp://", "etcd://")):
            raise ConfigError(
                f"peer {self.name}: master must be tcp:// or etcd://, got {self.master!r}"
            )
        check_token(self.token)
        if not 0 < self.share <= 1:
            raise ConfigError(f"peer {self.name}: share must be in (0, 1], got {self.share}")
        check_positive(self, "rpc_timeout", "probe_interval", "negative_entries", "copy_queue")
        check_nonnegative(self, "negative_ttl")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreClientConfig(Section):
    """Configuration of the embedded store client (``StoreClient``)."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_CLIENT_"

    master: str = "tcp://127.0.0.1:50051"
    """``tcp://host:port`` of the master (or ``etcd://…`` to follow the HA leader)."""
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
    poll_window: float = 200e-6
    """Seconds a call polls for the master's reply before it sleeps (0: sleep at once); the
    polling thread yields its CPU between polls and holds no GIL (docs/architecture.md,
    "Polling windows")."""

    peers: tuple[PeerConfig, ...] = ()
    """Peer clusters (federation): keys the home cluster does not have are looked up in
    them, in this order, and read straight from their store servers; writes stay home
    (unless a peer has ``copy_writes``). A list of :class:`PeerConfig` mappings (JSON text in
    the environment and on flags)."""
    peer_report_interval: float = 5.0
    """Seconds between two reports of the peers' use (breaker states, counters) to the home
    master, which ``kvconnect status`` shows (0: never; at most 10, the master forgets a
    client's report after 30 s)."""

    def __post_init__(self) -> None:
        check_positive(self, "rpc_timeout", "io_timeout", "replicas", "breaker_failures")
        check_positive(self, "breaker_cooldown", "negative_entries")
        check_nonnegative(self, "negative_ttl", "poll_window", "peer_report_interval")
        if self.peer_report_interval > 10:
            raise ConfigError(
                f"peer_report_interval must be at most 10 s, got {self.peer_report_interval}"
            )
        if len(self.peers) > MAX_PEERS:
            raise ConfigError(f"at most {MAX_PEERS} peers, got {len(self.peers)}")
        names = [peer.name for peer in self.peers]
        if len(set(names)) != len(names):
            raise ConfigError(f"peer names must be unique, got {names}")
        if any(peer.master == self.master for peer in self.peers):
            raise ConfigError(f"a peer cannot be the home cluster ({self.master})")


__all__ = [
    "MasterConfig",
    "PeerConfig",
    "StoreClientConfig",
    "StoreServerConfig",
    "Strategy",
    "TenantConfig",
]
