"""The router's configuration: one frozen, validated ``RouterConfig`` (``kvconnect router``'s
flags, :mod:`kvconnect.router.command`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvconnect._config import MiB, check_choice, check_positive
from kvconnect.errors import ConfigError
from kvconnect.router.cost import DECODE_TBT, K_WAITING, POOL_TPS, PREFILL_TPS
from kvconnect.router.types import Role


class PolicyName(enum.StrEnum):
    """How instances are chosen (docs/router.md)."""

    CACHE = "cache"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one source's KV events come from: a ZMQ PUB endpoint and its replay endpoint.

    ``instance`` is the fleet URL the events describe, or ``""`` for the store's own events
    (the shared pool)."""

    instance: str
    endpoint: str
    replay: str | None = None

    @classmethod
    def parse(cls, instance: str, text: str) -> EventSource:
        """``ENDPOINT[,REPLAY]`` → a source; ConfigError for an empty endpoint."""
        endpoint, _, replay = text.partition(",")
        if not endpoint.strip():
            raise ConfigError(f"KV events of {instance or 'the store'}: empty endpoint in {text!r}")
        return cls(instance, endpoint.strip(), replay.strip() or None)


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """Everything ``kvconnect router`` runs with; validated when built (ConfigError).

    Instance URLs are normalised (no trailing slash) and must be unique across roles."""

    prefill: tuple[str, ...] = ()
    """Prefill instances (vLLM API servers with a kv_both/kv_producer connector)."""
    decode: tuple[str, ...] = ()
    """Decode instances."""
    unified: tuple[str, ...] = ()
    """Instances that serve a whole request in one hop (no PD)."""
    events: tuple[EventSource, ...] = ()
    """KV-event sources of instances (each names one fleet URL)."""
    store_events: EventSource | None = None
    """The kvconnect store master's KV events (the shared pool), if published."""
    policy: PolicyName = PolicyName.CACHE
    ttft_slo: float | None = None
    """Seconds; a request predicted to exceed it is answered 429 (None: never)."""
    tbt_slo: float | None = None
    """Seconds per output token; likewise."""
    host: str = "127.0.0.1"
    port: int = 8000
    health_interval: float = 2.0
    """Seconds between two health checks of every instance."""
    health_timeout: float = 1.0
    """Seconds one health check (``/health`` and ``/metrics``) may take."""
    unhealthy_after: int = 2
    """Failed checks in a row that take an instance out."""
    request_timeout: float = 600.0
    """Seconds one upstream generation call may take in all."""
    connect_timeout: float = 5.0
    """Seconds to connect to an instance (a failure is retried elsewhere)."""
    call_timeout: float = 10.0
    """Seconds a small call (``/tokenize``, ``/v1/models``) may take; a request whose
    tokenisation fails is routed by load alone."""
    max_attempts: int = 3
    """Instances tried per hop for a request not yet started."""
    max_body_bytes: int = 16 * MiB
    """Largest request body accepted (413 beyond)."""
    block_size: int = 16
    """Tokens per KV block: must equal the engines' ``--block-size``."""
    index_capacity: int = 1 << 20
    """Block hashes the prefix index keeps at most (least recently used dropped)."""
    prefill_tps: float = PREFILL_TPS
    """Prior prefill throughput, tokens/s (calibrated online per instance)."""
    pool_tps: float = POOL_TPS
    """Tokens/s loaded from the shared pool instead of computed."""
    decode_tbt: float = DECODE_TBT
    """Prior seconds per output token at an empty decode instance."""
    k_waiting: float = K_WAITING
    """Weight of a waiting request against a running one in decode load."""
    seed: int = 0
    """Seed of the random policy."""

    def __post_init__(self) -> None:
        for role in Role:
            urls = tuple(_normalise(url) for url in getattr(self, role.value))
            object.__setattr__(self, role.value, urls)
        self._check_fleet()
        check_choice(self, "policy", PolicyName)
        check_positive(
            self,
            "health_interval",
            "health_timeout",
            "unhealthy_after",
            "request_timeout",
            "connect_timeout",
            "call_timeout",
            "max_attempts",
            "max_body_bytes",
            "block_size",
            "index_capacity",
            "prefill_tps",
            "pool_tps",
            "decode_tbt",
        )
        if self.k_waiting < 0:
            raise ConfigError(f"k_waiting must be >= 0, got {self.k_waiting}")
        for name in ("ttft_slo", "tbt_slo"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be > 0 (or unset), got {value}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        self._check_events()

    def roles(self) -> dict[str, Role]:
        """Every instance URL → its role."""
        return {url: role for role in Role for url in getattr(self, role.value)}

    def _check_fleet(self) -> None:
        urls = [url for role in Role for url in getattr(self, role.value)]
        duplicates = sorted({url for url in urls if urls.count(url) > 1})
        if duplicates:
            raise ConfigError(f"instances listed twice: {', '.join(duplicates)}")
        if not self.unified and not (self.prefill and self.decode):
            raise ConfigError("give prefill and decode instances, or unified ones (or both)")

    def _check_events(self) -> None:
        roles = self.roles()
        seen: set[str] = set()
        events = tuple(
            EventSource(_normalise(e.instance), e.endpoint, e.replay) for e in self.events
        )
        object.__setattr__(self, "events", events)
        for source in events:
            if source.instance not in roles:
                raise ConfigError(
                    f"KV events for {source.instance}, which is not an instance of the fleet"
                )
            if source.instance in seen:
                raise ConfigError(f"KV events of {source.instance} given twice")
            seen.add(source.instance)


def _normalise(url: str) -> str:
    """``url`` without a trailing slash; ConfigError unless it is an http(s) URL with a host."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"instance URLs must be http(s)://host:port, got {url!r}")
    if parts.query or parts.fragment:
        raise ConfigError(f"instance URL {url!r} must not have a query or fragment")
    return url.strip().rstrip("/")
