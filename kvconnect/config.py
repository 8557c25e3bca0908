"""Frozen, typed configuration, parsed once at the edge.

This is the only module of kvconnect that reads environment variables. Each component has one
dataclass; ``from_mapping`` builds it from JSON-like data and rejects unknown keys, ``from_env``
overlays ``KVCONNECT_<SECTION>_<FIELD>`` variables (and the shared ``KVCONNECT_TOKEN``).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Self, TypeVar

from kvconnect.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB

TransportName = Literal["auto", "local", "shm", "tcp"]
NativeMode = Literal["auto", "on", "off"]
MetadataKind = Literal["p2p", "embedded"]

_C = TypeVar("_C")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferConfig:
    """Configuration of one :class:`~kvconnect.transfer.TransferEngine`."""

    name: str | None = None
    """Segment name. Default: ``host:port`` of the listener (p2p) or a unique name (embedded)."""
    listen_host: str = "127.0.0.1"
    """Interface the peer listener binds to; never widened behind the user's back."""
    listen_port: int = 0
    """TCP port of the peer listener; 0 picks a free one."""
    advertise_host: str | None = None
    """Address peers should dial; required when ``listen_host`` is a wildcard."""
    metadata: MetadataKind = "p2p"
    """Where descriptors live: ``p2p`` asks the peer's listener, ``embedded`` is in-process."""
    transport: TransportName = "auto"
    """``auto`` picks local → shm → tcp per peer; any other value forces that transport."""
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
    """Connections the listener serves at once; more are refused (one thread each)."""
    max_frame_bytes: int = 256 * MiB
    """Largest payload of one frame the listener accepts; larger frames close the connection."""
    max_retries: int = 2
    """Times a frame is retried on another stream after a stream broke."""
    token: str | None = field(default=None, repr=False)
    """Cluster token; when set, peers must prove it (HMAC challenge) before any data moves."""
    native: NativeMode = "auto"
    """C extension for the data path: ``auto`` when built, ``on`` requires it, ``off`` never."""

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
            "max_frame_bytes",
        )
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
        if self.token is not None and not self.token:
            raise ConfigError("token must be a non-empty string or None")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Self:
        """Build from JSON-like data; unknown keys raise ConfigError listing the valid ones."""
        return _from_mapping(cls, data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """Read ``KVCONNECT_TRANSFER_<FIELD>`` and ``KVCONNECT_TOKEN``; ``overrides`` win."""
        env = os.environ if environ is None else environ
        values = _env_section(cls, env, "KVCONNECT_TRANSFER_")
        if "KVCONNECT_TOKEN" in env and "token" not in values:
            values["token"] = env["KVCONNECT_TOKEN"]
        values.update(overrides)
        return _from_mapping(cls, values)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


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
        try:
            return kind(value)  # type: ignore[no-any-return]
        except ValueError:
            pass
    raise ConfigError(
        f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
    )


__all__ = ["KiB", "MiB", "TransferConfig"]
