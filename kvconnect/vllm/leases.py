"""Prefill's leases on blocks kept for decode. Pure: time is passed in, no threads.

A finished prefill request's blocks stay allocated until every decode reader confirmed its
read (each confirmation says how many decode TP ranks read: prefill cannot know beforehand,
decode may run at another TP size), decode gave them up, or the lease lapsed. A confirmation
is answered ``OK`` only while the lease still holds: release is irreversible and happens only
through this table, so ``OK`` proves the blocks were held for the whole read that preceded
it. Anything else tells decode that what it read may be another request's KV.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field


class Confirmation(enum.Enum):
    """Prefill's answer to a reader's 'I have read the blocks'."""

    OK = "ok"
    """The blocks were held throughout: the bytes read are this request's KV."""
    EXPIRED = "expired"
    """The blocks were released (lease lapsed, or unknown request): do not use the bytes."""


@dataclass(slots=True)
class _Lease:
    deadline: float
    readers: int = 0  # decode ranks that read, as the confirmations say (0: none came yet)
    confirmed: set[int] = field(default_factory=set)


class LeaseTable:
    """Blocks held for decode, by prefill request id."""

    def __init__(self, duration: float) -> None:
        self.duration = duration
        self._leases: dict[str, _Lease] = {}
        self._released: list[str] = []
        self.expired = 0
        """Leases that lapsed (decode never came, or came too late)."""

    def __len__(self) -> int:
        return len(self._leases)

    def hold(self, request_id: str, now: float) -> None:
        """Keep ``request_id``'s blocks until every decode reader confirmed."""
        self._leases[request_id] = _Lease(now + self.duration)

    def renew(self, request_ids: Iterable[str], now: float) -> None:
        """Decode still wants these; leases that already lapsed stay lapsed."""
        self.expire(now)
        for request_id in request_ids:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.deadline = now + self.duration

    def confirm(self, request_id: str, reader: int, readers: int, now: float) -> Confirmation:
        """Reader ``reader`` of ``readers`` has read the blocks; the last reader releases
        them. Confirmations that disagree on ``readers`` wait for the most they name."""
        self.expire(now)
        lease = self._leases.get(request_id)
        if lease is None:
            return Confirmation.EXPIRED
        lease.readers = max(lease.readers, readers)
        lease.confirmed.add(reader)
        if len(lease.confirmed) >= lease.readers:
            self._release(request_id)
        return Confirmation.OK

    def give_up(self, request_ids: Iterable[str]) -> None:
        """Decode will not read these (aborted, or it had the prefix already)."""
        for request_id in request_ids:
            if request_id in self._leases:
                self._release(request_id)

    def expire(self, now: float) -> None:
        """Release every lease whose deadline passed."""
        lapsed = [rid for rid, lease in self._leases.items() if lease.deadline < now]
        self.expired += len(lapsed)
        for request_id in lapsed:
            self._release(request_id)

    def take_released(self) -> list[str]:
        """Requests whose blocks may be freed now (each returned once)."""
        released, self._released = self._released, []
        return released

    def _release(self, request_id: str) -> None:
        del self._leases[request_id]
        self._released.append(request_id)
