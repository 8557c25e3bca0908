"""The backend's settings, parsed once, from SGLang's ``--hicache-storage-backend-extra-config``.

Precedence, highest first: the extra-config JSON, then the JSON file it (or the environment)
names as ``config_file``, then ``KVCONNECT_SGLANG_*`` environment variables (and, for the
embedded sections, ``KVCONNECT_CLIENT_*`` and ``KVCONNECT_TRANSFER_*`` below those). The
extra-config is shared with SGLang: the keys SGLang itself reads there are accepted and left to
SGLang; any other key that is not a kvconnect setting is an error listing the valid ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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
from kvconnect.store.config import StoreClientConfig
from kvconnect.transfer.config import TransferConfig

_ROUTES = {
    "master": Route("store", "master", "tcp://127.0.0.1:50051"),
    "transport": Route("transfer", "transport", "auto"),
    "listen_host": Route("transfer", "listen_host", "127.0.0.1"),
    "rpc_timeout": Route("store", "rpc_timeout", 0.5),
    "breaker_failures": Route("store", "breaker_failures", 3),
    "breaker_cooldown": Route("store", "breaker_cooldown", 2.0),
    "negative_ttl": Route("store", "negative_ttl", 10.0),
}
"""The flat keys of the backend (all it had before it embedded its sections) → where they go.

``master`` is the store master (``tcp://host:port`` or ``etcd://host:port[,…]`` with master
HA); ``transport`` the transfer transport to the store servers (``auto``: shared memory on the
same host); ``listen_host`` the interface of this process's transfer engine (matters with
``local_store_size``); ``rpc_timeout`` the timeout of one call to the master;
``breaker_failures`` the consecutive failures after which the backend runs local-only (no
L3), ``breaker_cooldown`` the seconds of that before one probe of the store; ``negative_ttl``
the seconds a page whose read failed is reported absent (no repeated timeouts on it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HiCacheConfig(Composed):
    """Configuration of the SGLang HiCache L3 backend (``kvconnect.sglang``), one per SGLang
    scheduler process (TP rank). Embeds the store client's and its transfer engine's sections;
    the flat keys of ``_ROUTES`` set fields of those."""

    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_SGLANG_"
    _ROUTES: ClassVar[Mapping[str, Route]] = _ROUTES

    store: StoreClientConfig = field(
        default_factory=embedded_default(StoreClientConfig, _ROUTES, "store")
    )
    """The store client (every :class:`StoreClientConfig` key, e.g. ``replicas``)."""
    transfer: TransferConfig = field(
        default_factory=embedded_default(TransferConfig, _ROUTES, "transfer")
    )
    """The transfer engine of the store client; its token is this section's (below)."""
    config_file: str = ""
    """A JSON file with more of these settings (below the extra-config, above the
    environment)."""
    namespace: str = ""
    """Prefix of every key: separate caches (deployments, tenants) that share one store."""
    read_timeout: float | None = None
    """An upper bound on one read of up to 128 pages, in seconds; unset (the default), reads
    end by the deadline derived from SGLang's prefetch budget (kvconnect/sglang/deadline.py).
    Either way the pages that arrived by then, from the first on, are used and the rest is
    recomputed."""
    deadline_margin: float = 0.25
    """Seconds before SGLang's ``timeout`` verdict by which a read answers, for its
    acknowledgement to reach the scheduler (at most a quarter of the budget)."""
    write_timeout: float = 5.0
    """Deadline of one write of up to 128 pages (the backup thread's)."""
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
        check_positive(self, "write_timeout")
        if self.read_timeout is not None:
            check_positive(self, "read_timeout")
        if self.deadline_margin < 0:
            raise ConfigError(f"deadline_margin must be >= 0, got {self.deadline_margin}")
        if self.local_store_size < 0:
            raise ConfigError(f"local_store_size must be >= 0, got {self.local_store_size}")
        if not self.store.master.startswith(("tcp://", "etcd://")):
            raise ConfigError(
                f"master must be tcp://host:port or etcd://…, got {self.store.master!r}"
            )

    def cluster_token(self) -> str | None:
        """The token this backend authenticates with (see :func:`cluster_token`)."""
        return cluster_token(None, self.token_file, self.insecure)


SGLANG_KEYS = frozenset(
    {
        # the ``dynamic`` backend loader (storage/backend_factory.py, cache_controller.py)
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        # the controller's prefetch settings; SGLang pops them before building the backend
        # on most paths, but not all (the PD decode offload manager passes the JSON as is)
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
        # added by SGLang from --file-storage-path (unified_radix_cache.py), for every backend
        "file_storage_path",
    }
)
"""Extra-config keys SGLang 0.5.23 reads (or writes) itself, whatever the backend."""


def parse_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> HiCacheConfig:
    """The backend's configuration; raises ConfigError for unknown keys or bad values."""
    extra = extra or {}
    settings = HiCacheConfig.valid_keys()
    unknown = sorted(set(extra) - settings - SGLANG_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)} in --hicache-storage-backend-extra-config; "
            f"valid: kvconnect's {', '.join(sorted(settings))}, and SGLang's own "
            f"{', '.join(sorted(SGLANG_KEYS))}"
        )
    inline = {k: v for k, v in extra.items() if k not in SGLANG_KEYS}
    return layered(HiCacheConfig, inline, environ)
