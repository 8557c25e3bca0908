"""The master's log of removed objects: a bounded ring that clients page through.

Pure (no sockets, threads or clock). The master records every complete object that stops
existing (removed, evicted, or lost with its last segment) under a sequence number; a client
that mirrors part of the key space (the vLLM pool's KV events) asks for the removals under its
key prefix since the last sequence number it saw. The ring keeps the latest
:data:`REMOVAL_LOG` entries: a client that falls further behind learns how many it missed
(``RemovalsReply.first`` is past its ``since``) instead of being answered as if nothing was
lost. Each answer scans at most :data:`REMOVAL_SCAN` entries, so a prefix that matches rarely
costs bounded work per request (the client pages on from ``next``).
"""

from __future__ import annotations

import collections
import itertools
import secrets

from kvconnect.store.messages import Removal, RemovalReason, RemovalsReply

REMOVAL_LOG = 65536
"""Removals the master remembers (about 10 MiB of keys at typical KV key lengths)."""
REMOVAL_SCAN = 16384
"""Log entries one Removals request examines, at most."""
MAX_REMOVALS = 4096
"""Removals one reply carries, at most (whatever the request's ``limit``)."""


class RemovalLog:
    """Removed keys by sequence number (1, 2, …); ``epoch`` names this log, so a client that
    sees another epoch (a master restart or failover: a fresh log) starts again from 0."""

    def __init__(self, capacity: int = REMOVAL_LOG) -> None:
        self.epoch = secrets.randbits(53)  # exact in any msgpack/JSON consumer
        self._entries: collections.deque[tuple[str, RemovalReason]] = collections.deque(
            maxlen=capacity
        )
        self._next = 1  # sequence number of the next entry

    @property
    def first(self) -> int:
        """Sequence number of the oldest entry still kept (``next`` when empty)."""
        return self._next - len(self._entries)

    def record(self, key: str, reason: RemovalReason) -> None:
        """``key`` (a complete object) no longer exists."""
        self._entries.append((key, reason))
        self._next += 1

    def since(self, prefix: str, since: int, limit: int) -> RemovalsReply:
        """Removals under ``prefix`` with sequence numbers above ``since``: at most
        ``min(limit, MAX_REMOVALS)`` of them, from at most :data:`REMOVAL_SCAN` entries.
        ``next`` in the reply is where the client continues (every entry up to it was
        examined); ``first`` above ``since + 1`` means entries were lost to the ring."""
        first = self.first
        start = min(max(since + 1, first), self._next)
        stop = min(self._next, start + REMOVAL_SCAN)
        limit = max(1, min(limit, MAX_REMOVALS))
        found: list[Removal] = []
        last = start - 1  # the last entry examined
        entries = itertools.islice(self._entries, start - first, stop - first)
        for seq, (key, reason) in enumerate(entries, start):
            last = seq
            if key.startswith(prefix):
                found.append(Removal(seq, key, reason))
                if len(found) == limit:
                    break
        return RemovalsReply(self.epoch, first, last, found)
