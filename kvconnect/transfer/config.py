"""The transfer engine's section of the configuration: :class:`TransferConfig` (machinery in
``kvconnect._config``)."""

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
from kvconnect.etcd import parse_url


class TransportName(enum.StrEnum):
    """``TransferConfig.transport``: ``auto`` routes per peer, any other forces that transport."""

    AUTO = "auto"
    LOCAL = "local"
    SHM = "shm"
    TCP = "tcp"
    RDMA = "rdma"


class NativeMode(enum.StrEnum):
    """``TransferConfig.native``: the C data path if built (``auto``), required, or not used."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferConfig(Section):
    """Configuration of one :class:`~kvconnect.transfer.TransferEngine`."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_TRANSFER_"
    _SHARED_ENV: ClassVar[dict[str, str]] = AUTH_ENV

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
    transport: TransportName = TransportName.AUTO
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
    poll_window: float = 200e-6
    """Seconds a thread polls for an answer due within microseconds before it sleeps (0:
    sleep at once). The submitting thread of a small TCP request sent on an idle connection
    waits this long for the response and completes the request itself (no hand-off to the
    receiver thread); a listener thread polls this long for its connection's next frame
    after answering a small one. Polling yields the CPU between polls and holds no GIL
    (docs/transfer.md, "Polling")."""
    poll_threads: int = 1
    """Listener threads that may poll at once (the others sleep at once): bounds the CPU a
    listener spends polling however many peers it serves."""
    token: str | None = field(default=None, repr=False)
    """Cluster token: peers must prove it (HMAC challenge) before any data moves. Prefer
    ``token_file``; unset, :func:`cluster_token` finds or generates one."""
    token_file: str = ""
    """File holding the cluster token (first line); read when ``token`` is unset."""
    insecure: bool = False
    """Run without a token when none is configured (anyone who reaches the listener may read
    and write registered memory); otherwise a token is always used."""
    native: NativeMode = NativeMode.AUTO
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
        check_choice(self, "transport", TransportName)
        check_choice(self, "native", NativeMode)
        check_positive(
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
            "poll_threads",
        )
        check_nonnegative(self, "poll_window")
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
        check_token(self.token)

    def cluster_token(self) -> str | None:
        """The token this engine uses (see :func:`cluster_token`)."""
        return cluster_token(self.token, self.token_file, self.insecure)


def _check_metadata(metadata: str) -> None:
    if metadata in ("p2p", "embedded"):
        return
    if not metadata.startswith("etcd://"):
        raise ConfigError(
            "metadata must be p2p, embedded or an etcd://host:port[,host:port] URL; "
            f"got {metadata!r}"
        )
    parse_url(metadata)  # ConfigError naming the bad endpoint


__all__ = ["NativeMode", "TransferConfig", "TransportName"]
