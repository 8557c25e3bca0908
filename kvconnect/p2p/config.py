"""The P2P store's section of the configuration (machinery in ``kvconnect._config``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from kvconnect._config import Composed, MiB, Route, check_positive, embedded_default
from kvconnect.errors import ConfigError
from kvconnect.etcd import parse_url
from kvconnect.transfer.config import TransferConfig

_ROUTES: Mapping[str, Route] = {
    "listen_host": Route("transfer", "listen_host", "127.0.0.1"),
    "advertise_host": Route("transfer", "advertise_host", None),
    "token_file": Route("transfer", "token_file", ""),
    "insecure": Route("transfer", "insecure", False),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class P2PConfig(Composed):
    """Configuration of one :class:`~kvconnect.p2p.P2PNode` (docs/p2p.md): where the
    manifests and holders live, how objects are cut, how a fetch spreads over holders. Embeds
    the node's transfer engine section; ``listen_host``, ``advertise_host``, ``token_file``
    and ``insecure`` set its fields."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_P2P_"
    _ROUTES: ClassVar[Mapping[str, Route]] = _ROUTES

    transfer: TransferConfig = field(
        default_factory=embedded_default(TransferConfig, _ROUTES, "transfer")
    )
    """The node's transfer engine: holders serve chunks on its listener, fetchers read with it
    (its token is the swarm's: every node of a swarm proves the same one)."""
    etcd: str = "etcd://127.0.0.1:2379"
    """etcd holding manifests and holders (``etcd://host:port[,host:port…]``)."""
    prefix: str = "/kvconnect/p2p/"
    """Key prefix of this swarm in etcd (separate swarms may share one etcd)."""
    chunk_bytes: int = 4 * MiB
    """Size of a chunk when publishing (a file's last chunk may be shorter): the unit that is
    verified, announced and served on; smaller chunks spread sooner, cost more etcd writes.
    Objects too large for ``MAX_CHUNKS`` chunks of this size get larger ones (docs/p2p.md)."""
    parallel: int = 8
    """Chunks a fetch moves at once (over all holders)."""
    per_holder: int = 1
    """Chunks a fetch reads from one holder at once: spreads the load over the swarm (one
    at a time finishes each chunk soonest, so it is served on sooner: docs/p2p.md has the
    measurements)."""
    lease_ttl: int = 5
    """Seconds of the etcd lease on this node's holder records: a holder that dies without
    closing stops being offered within about this long."""
    announce_interval: float = 0.05
    """Seconds between two updates of a holder record: chunks verified meanwhile are
    announced together."""
    chunk_timeout: float = 60.0
    """Deadline of one chunk's transfer from one holder; past it the chunk goes to another."""
    retry_after: float = 2.0
    """Seconds a fetch leaves alone a holder whose transfer failed (dead, or unreachable)."""
    stall_timeout: float = 60.0
    """A fetch fails after this long without a chunk arriving and with no transfer under way
    (no holder has what it lacks, or none can be reached)."""
    share: bool = True
    """Serve what this node fetches, from the first verified chunk on (``False``: a node
    that only downloads; what it publishes is always served)."""
    locality: str = ""
    """This node's place (a rack, a zone): holders with the same one are preferred after
    holders on the same host. Empty: nodes on the same /24 (IPv4) count as near."""

    def __post_init__(self) -> None:
        parse_url(self.etcd)
        check_positive(self, "chunk_bytes", "parallel", "per_holder", "lease_ttl", "chunk_timeout")
        check_positive(self, "announce_interval", "retry_after", "stall_timeout")
        if not self.prefix.startswith("/") or not self.prefix.endswith("/"):
            raise ConfigError(f"prefix must start and end with '/', got {self.prefix!r}")
        if not 4096 <= self.chunk_bytes <= 1024 * MiB:
            raise ConfigError(f"chunk_bytes must be 4 KiB .. 1 GiB, got {self.chunk_bytes}")
