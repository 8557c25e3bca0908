"""Tenants at the master: each its own namespace of keys, a quota and a share (pure).

A client that proved a tenant's token (:func:`kvconnect._config.tenant_token`) is that tenant
for every request on its connection. The master stores its keys under the tenant's prefix
(``GS name GS``, a control character no key of another tenant can begin with, since each
tenant's keys get its own prefix), so a tenant's requests reach only its own objects: it
cannot look up, read, remove or list another's keys. Requests only the cluster's own
processes make (mount, report, unmount, heartbeat) are DENIED to tenants, and a tenant's
stats show only itself. The prefix is part of the stored key, so it survives a master restart
or failover like the key (store servers report their objects' keys).

Quotas and shares are enforced by :class:`~kvconnect.store.master.state.MasterState` with the
per-tenant bytes :class:`~kvconnect.store.master.objects.ObjectTable` keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import msgspec
import numpy as np

from kvconnect.store import messages as m
from kvconnect.store.config import TenantConfig
from kvconnect.store.master.objects import ObjectTable

SEPARATOR = "\x1d"
NONE = 0
"""The tenant id of keys of no tenant (the cluster's own clients)."""

_ADMIN = (m.Mount, m.Report, m.Unmount, m.Heartbeat)


class Tenants:
    """The configured tenants, by id (1, 2, …; :data:`NONE` is no tenant)."""

    def __init__(self, configs: Sequence[TenantConfig]) -> None:
        self.configs = list(configs)
        self._ids = {config.name: n for n, config in enumerate(configs, start=1)}

    def __len__(self) -> int:
        return len(self.configs)

    def id(self, name: str | None) -> int:
        """The id of tenant ``name`` (NONE for None or a name not configured)."""
        return NONE if name is None else self._ids.get(name, NONE)

    def id_of_key(self, key: str) -> int:
        """The tenant a stored key belongs to (NONE for keys outside every tenant's prefix)."""
        if not of_a_tenant(key):
            return NONE
        end = key.find(SEPARATOR, 1)
        return NONE if end < 0 else self._ids.get(key[1:end], NONE)

    def quota(self, tenant: int) -> int:
        """Bytes tenant ``tenant`` may keep in memory (0: no quota)."""
        return self.configs[tenant - 1].quota if tenant != NONE else 0

    def disk_quota(self, tenant: int) -> int:
        """Bytes tenant ``tenant`` may keep on disk (0: no quota)."""
        return self.configs[tenant - 1].disk_quota if tenant != NONE else 0

    def with_disk_quota(self) -> list[int]:
        """The tenants with a disk quota."""
        return [n for n, config in enumerate(self.configs, start=1) if config.disk_quota]

    def share(self, tenant: int) -> int:
        """Bytes tenant ``tenant`` is entitled to when the store is full (0: none declared)."""
        if tenant == NONE:
            return 0
        config = self.configs[tenant - 1]
        return config.share or config.quota

    def over_share(self, used: Callable[[int], int]) -> np.ndarray:
        """By tenant id: whether the tenant holds more than its share (``used``: its bytes in
        memory); never NONE, nor a tenant without a share."""
        shares = [self.share(t) for t in range(len(self.configs) + 1)]
        return np.array([0 < share < used(t) for t, share in enumerate(shares)], bool)

    def stats(
        self, objects: ObjectTable, evictions: Mapping[int, int], only: int | None = None
    ) -> list[m.TenantStats]:
        """Every tenant's usage (or tenant ``only``'s)."""
        ids = range(1, len(self.configs) + 1) if only is None else [only]
        return [
            m.TenantStats(
                name=self.configs[t - 1].name,
                quota=self.quota(t),
                disk_quota=self.disk_quota(t),
                share=self.share(t),
                used=objects.tenant_memory(t),
                disk_used=objects.tenant_disk[t],
                objects=objects.tenant_objects[t],
                evictions=evictions.get(t, 0),
            )
            for t in ids
            if t != NONE
        ]


def within(room: int, sizes: Sequence[int]) -> list[bool]:
    """Which of ``sizes``, in order, fit in ``room`` bytes (each taking its room)."""
    fits = []
    for size in sizes:
        fits.append(size <= room)
        if size <= room:
            room -= size
    return fits


def of_a_tenant(key: str) -> bool:
    """Whether stored key ``key`` lies in a tenant's namespace."""
    return key.startswith(SEPARATOR)


def prefix(tenant: str) -> str:
    """What every stored key of ``tenant`` begins with."""
    return f"{SEPARATOR}{tenant}{SEPARATOR}"


def scoped(request: m.Request, tenant: str) -> m.Request | m.Error:
    """``request`` of ``tenant`` with its keys under the tenant's prefix (an invalid key stays
    invalid), or DENIED for a request tenants may not make."""
    if isinstance(request, _ADMIN):
        return m.Error(m.Code.DENIED, f"tenant {tenant} may not {type(request).__name__.lower()}")
    head = prefix(tenant)
    if isinstance(request, m.PutStart):
        items = [msgspec.structs.replace(i, key=_scope(head, i.key)) for i in request.items]
        return msgspec.structs.replace(request, items=items)
    if isinstance(request, m.Removals):
        if len(request.prefix.encode(errors="replace")) > m.MAX_KEY_BYTES:
            return m.Error(m.Code.INVALID, f"prefix longer than {m.MAX_KEY_BYTES} bytes")
        return msgspec.structs.replace(request, prefix=head + request.prefix)
    if isinstance(request, m.Exists | m.PutEnd | m.PutRevoke | m.GetReplicas | m.Remove):
        return msgspec.structs.replace(request, keys=[_scope(head, key) for key in request.keys])
    return request


def unscoped(reply: m.Reply, tenant: str) -> m.Reply:
    """``reply`` to a request of ``tenant`` as the tenant sees it: keys without the prefix."""
    if isinstance(reply, m.RemovalsReply):
        cut = len(prefix(tenant))
        removed = [msgspec.structs.replace(r, key=r.key[cut:]) for r in reply.removed]
        return msgspec.structs.replace(reply, removed=removed)
    return reply


def _scope(head: str, key: str) -> str:
    # Cheap on purpose (a batch's keys each time): an empty key stays empty, one the master
    # refuses (NUL, a lone surrogate) stays refused under the prefix, and one a little over
    # MAX_KEY_BYTES can only ever reach the tenant's own namespace.
    return head + key if key else ""
