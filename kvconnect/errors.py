"""The one exception tree of kvconnect, branched by what the caller does next.

- ``ConfigError``: fix the configuration or the call; retrying will not help.
- ``ClosedError``: *you* closed the object; it will not work again.
- ``BrokenError``: something outside failed (a peer died, a link dropped); retry elsewhere or later.
- ``ProtocolError``: the peer speaks another version or sent garbage; the connection is dropped.
- ``TransferError``: a transfer did not complete (``TransferTimeout``, ``AccessDenied``,
  ``SourceUnavailable`` refine it).
- ``RegistrationError``: memory could not be registered or unregistered.
- ``StoreError``: a store call failed as a whole (``MasterUnavailable``, ``CircuitOpen``).
"""

from __future__ import annotations


class KVConnectError(Exception):
    """Root of every error kvconnect raises on purpose."""


class ConfigError(KVConnectError, ValueError):
    """Invalid configuration or invalid arguments; the message names the valid choices."""


class InvalidRequest(ConfigError):
    """A transfer request is malformed on the caller's side (bounds, unregistered local region)."""


class ClosedError(KVConnectError):
    """The object was closed by its owner and cannot be used any more."""


class BrokenError(KVConnectError):
    """A peer, link or device failed; ``__cause__`` often carries the underlying OSError."""


class PeerUnreachable(BrokenError):
    """A peer could not be reached or died while serving a request."""


class SegmentNotFound(KVConnectError):
    """No segment of that name is known to the metadata backend."""


class ProtocolError(KVConnectError):
    """A peer sent a malformed frame, an unsupported version or a failed handshake."""


class AuthenticationError(ProtocolError):
    """The peer did not prove knowledge of the cluster token (or we lack it)."""


class TransferError(KVConnectError):
    """A transfer failed; ``statuses``/``errors`` hold per-request details for a batch."""

    def __init__(
        self,
        message: str,
        *,
        statuses: tuple[object, ...] = (),
        errors: tuple[BaseException | None, ...] = (),
    ) -> None:
        super().__init__(message)
        self.statuses = statuses
        self.errors = errors


class SourceUnavailable(TransferError):
    """The bytes cannot be served: a read of a FILE region's source failed or did not verify."""


class TransferTimeout(TransferError):
    """A request did not complete before its deadline."""


class AccessDenied(TransferError):
    """The target refused the access: unknown region, out of bounds, or read-only."""


class RegistrationError(KVConnectError):
    """Memory could not be registered or unregistered."""


class RegionBusy(RegistrationError):
    """The region is in use by transfers and cannot be unregistered now."""


class StoreError(KVConnectError):
    """A store operation failed as a whole (per-key outcomes are codes, not exceptions)."""


class MasterUnavailable(StoreError, BrokenError):
    """The store master did not answer within the timeout, or is not connected."""


class NotLeader(StoreError):
    """This master is a standby (or stepped down); ask the current leader."""


class CoordinationUnavailable(BrokenError):
    """etcd could not be reached or did not answer in time."""


class CircuitOpen(StoreError):
    """The client fails fast: the store failed repeatedly and is cooling down."""


class DiskUnavailable(StoreError):
    """A disk tier cannot be used at all (its files cannot be created, opened, sized or locked)."""


class P2PError(KVConnectError):
    """A P2P store operation failed: an unknown object, a fetch that no holder can complete,
    a publish that conflicts with what is published."""


__all__ = [
    "AccessDenied",
    "AuthenticationError",
    "BrokenError",
    "CircuitOpen",
    "ClosedError",
    "ConfigError",
    "CoordinationUnavailable",
    "DiskUnavailable",
    "InvalidRequest",
    "KVConnectError",
    "MasterUnavailable",
    "NotLeader",
    "P2PError",
    "PeerUnreachable",
    "ProtocolError",
    "RegionBusy",
    "RegistrationError",
    "SegmentNotFound",
    "SourceUnavailable",
    "StoreError",
    "TransferError",
    "TransferTimeout",
]
