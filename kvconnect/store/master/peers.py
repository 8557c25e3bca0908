"""Federating clients' reports of their peer clusters, for ``kvconnect status`` (pure).

A client with peers reports its use of each (breaker state and counters) to its home master
every few seconds (:class:`~kvconnect.store.messages.PeerReport`); the master keeps the latest
report of each client for :data:`REPORT_TTL` and sums them per peer. Reports are statistics
only: they change nothing the master decides. Bounded whatever clients send — at most
:data:`MAX_CLIENTS` clients (the stalest report gives way), ``MAX_PEERS`` peers a report,
names of bounded length — and a tenant's clients' reports are shown only to that tenant and
to the cluster's own clients.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import msgspec

from kvconnect.store import messages as m

REPORT_TTL = 30.0
"""Seconds a client's report counts (a client that stopped reporting is gone)."""
MAX_CLIENTS = 1024
"""Clients whose reports the master keeps at most."""
MAX_NAME_BYTES = 256
"""Longest client id, peer name or peer master a report may carry."""


class PeerReports:
    """The latest report of each client, by (tenant, client)."""

    def __init__(self, ttl: float = REPORT_TTL, capacity: int = MAX_CLIENTS) -> None:
        self._ttl = ttl
        self._capacity = capacity
        self._reports: collections.OrderedDict[tuple[int, str], tuple[float, m.PeerReport]] = (
            collections.OrderedDict()
        )
        # Sums by tenant (None: all), until a report comes or goes: the master's stats snapshot
        # asks every second, and a full table is 16k peer entries to add up.
        self._sums: dict[int | None, list[m.PeerSummary]] = {}

    def record(self, tenant: int, report: m.PeerReport, now: float) -> m.Code | m.Error:
        """Keep ``report`` (of a client of ``tenant``) as that client's latest."""
        problem = _invalid(report)
        if problem:
            return m.Error(m.Code.INVALID, f"peer report: {problem}")
        key = (tenant, report.client)
        self._reports.pop(key, None)
        self._reports[key] = (now, report)
        self._sums.clear()
        self._expire(now)
        while len(self._reports) > self._capacity:
            self._reports.popitem(last=False)
        return m.Code.OK

    def summary(self, now: float, tenant: int | None = None) -> list[m.PeerSummary]:
        """Per peer (by name, in order of first appearance), the sums over the clients that
        reported it within the TTL; only ``tenant``'s clients when given."""
        self._expire(now)
        if tenant not in self._sums:
            self._sums[tenant] = _summed(
                report
                for (owner, _), (_, report) in self._reports.items()
                if tenant is None or owner == tenant
            )
        return self._sums[tenant]

    def _expire(self, now: float) -> None:
        while self._reports:
            (at, _) = next(iter(self._reports.values()))
            if now - at <= self._ttl:
                return
            self._reports.popitem(last=False)
            self._sums.clear()


def _invalid(report: m.PeerReport) -> str:
    """Why ``report`` cannot be kept ('' if it can)."""
    if len(report.peers) > m.MAX_PEERS:
        return f"{len(report.peers)} peers, at most {m.MAX_PEERS}"
    names = [report.client] + [n for use in report.peers for n in (use.peer, use.master)]
    if any(not name or len(name.encode(errors="replace")) > MAX_NAME_BYTES for name in names):
        return f"names must be 1 to {MAX_NAME_BYTES} bytes"
    counts = [n for use in report.peers for n in msgspec.structs.astuple(use.counts)]
    if min([report.home_hits, *counts]) < 0:
        return "negative count"
    if len({use.peer for use in report.peers}) != len(report.peers):
        return "a peer named twice"
    return ""


def _summed(reports: Iterable[m.PeerReport]) -> list[m.PeerSummary]:
    rows: dict[str, tuple[str, list[int]]] = {}  # peer: master, [clients, down, reads, *counts]
    for report in reports:
        reads = report.home_hits + sum(use.counts.hits for use in report.peers)
        for use in report.peers:
            _, row = rows.setdefault(use.peer, (use.master, [0] * 9))
            for i, n in enumerate((1, not use.up, reads, *msgspec.structs.astuple(use.counts))):
                row[i] += n
    return [
        m.PeerSummary(peer, master, row[0], row[1], row[2], m.PeerCounts(*row[3:]))
        for peer, (master, row) in rows.items()
    ]
