"""Decode's cache of prefill engines' KV layouts, with explicit eviction.

A decode worker asks a prefill side channel for its layouts (``GetLayout``) the first time it
reads from that prefill engine and keeps the whole :class:`~kvconnect.vllm.messages.LayoutReply`.
Prefill engines come and go: one may be replaced at the same side-channel endpoint (same port,
new engine id) or killed while decode still holds its layout. The cache is keyed by endpoint,
since an endpoint serves one engine at a time, and entries go when they are stale:

- a read from the engine failed: its layout is asked again before the next read (a new engine
  at the endpoint then replaces it);
- the endpoint answers with another engine id: the old entry is dropped, the new engine is
  cached and used by its own requests at once; the request planned for the old engine fails
  (:class:`PeerReplaced`: recomputed or failed per ``kv_load_failure_policy``);
- more than ``capacity`` endpoints: the least recently used goes (prefills that moved away).

Whenever an entry goes for good, ``on_evict`` gets its reply (the worker drops its transfer
engine's state for the segments no longer named by any entry). Refusals (incompatible KV) are
kept per entry, so a replacement engine is judged afresh.

Thread-safe: the worker's read lanes call it concurrently. No lock is held during I/O, so two
concurrent first reads may both ask; the last answer wins, both are correct.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvconnect.errors import ConfigError, PeerUnreachable
from kvconnect.vllm import messages as msg
from kvconnect.vllm.layout import IncompatiblePeer
from kvconnect.vllm.sidechannel import SideChannelClient

log = logging.getLogger(__name__)

CAPACITY = 256  # prefill endpoints remembered per decode rank; a fleet has fewer


class PeerReplaced(PeerUnreachable):
    """The prefill engine a request was planned for no longer serves its endpoint."""


@dataclass(slots=True)
class _Entry:
    reply: msg.LayoutReply
    fresh: bool = True  # False after a failed read: ask the endpoint again first
    refusal: str | None = None  # why this engine's KV is never read here


class PeerLayouts:
    """Prefill layouts by side-channel endpoint (see the module docstring)."""

    def __init__(
        self,
        client: SideChannelClient,
        *,
        capacity: int = CAPACITY,
        on_evict: Callable[[msg.LayoutReply], None] = lambda _reply: None,
    ) -> None:
        """``client`` makes the ``GetLayout`` calls; ``on_evict`` runs (outside the lock, on
        the calling thread; it must not raise) for every entry that goes."""
        self._client = client
        self._capacity = capacity
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()

    def get(self, endpoint: str, engine_id: str) -> msg.LayoutReply:
        """The layouts of prefill engine ``engine_id`` at ``endpoint`` (asked there unless
        cached and fresh; blocks for at most one side-channel call). Raises IncompatiblePeer
        if :meth:`refuse` refused that engine, PeerReplaced if another engine serves the
        endpoint now, PeerUnreachable or ConfigError if the endpoint has no layout to give."""
        with self._lock:
            entry = self._entries.get(endpoint)
            if entry is not None and entry.reply.engine_id == engine_id:
                self._entries.move_to_end(endpoint)
                if entry.refusal is not None:
                    raise IncompatiblePeer(entry.refusal)
                if entry.fresh:
                    return entry.reply
        answer = self._client.call(endpoint, msg.GetLayout())
        if not isinstance(answer, msg.LayoutReply):
            raise ConfigError(f"prefill {endpoint} has no KV layout to offer: {answer!r}")
        self._store(endpoint, answer)
        if answer.engine_id != engine_id:
            raise PeerReplaced(
                f"{endpoint} is prefill engine {answer.engine_id} now, not {engine_id} "
                "(restarted): the KV planned there is gone"
            )
        return answer

    def read_failed(self, endpoint: str, engine_id: str) -> None:
        """A read from ``engine_id`` failed: ask ``endpoint`` again before the next one (the
        layout stays known, so a replacement found then still evicts it)."""
        with self._lock:
            entry = self._entries.get(endpoint)
            if entry is not None and entry.reply.engine_id == engine_id:
                entry.fresh = False

    def refuse(self, endpoint: str, engine_id: str, refusal: str) -> bool:
        """Never read ``engine_id``'s KV (while it serves ``endpoint``); True the first time."""
        with self._lock:
            entry = self._entries.get(endpoint)
            if entry is None or entry.reply.engine_id != engine_id:
                return True  # replaced meanwhile: the new engine is judged on its own
            first, entry.refusal = entry.refusal is None, refusal
            return first

    def engines(self) -> dict[str, str]:
        """Endpoint → engine id of every entry, least recently used first (a snapshot)."""
        with self._lock:
            return {endpoint: e.reply.engine_id for endpoint, e in self._entries.items()}

    def segments(self) -> set[str]:
        """The transfer-engine segments the cached layouts name."""
        with self._lock:
            return {r.segment for e in self._entries.values() for r in e.reply.ranks.values()}

    def _store(self, endpoint: str, reply: msg.LayoutReply) -> None:
        evicted: list[tuple[str, msg.LayoutReply, str]] = []  # endpoint, reply, why
        with self._lock:
            old = self._entries.get(endpoint)
            if old is not None and old.reply.engine_id == reply.engine_id:
                old.reply, old.fresh = reply, True
                self._entries.move_to_end(endpoint)
                return
            if old is not None:
                evicted.append((endpoint, old.reply, f"replaced by {reply.engine_id}"))
            self._entries[endpoint] = _Entry(reply)
            self._entries.move_to_end(endpoint)
            while len(self._entries) > self._capacity:
                aged, entry = self._entries.popitem(last=False)
                evicted.append((aged, entry.reply, "aged out"))
        for where, gone, why in evicted:
            log.info("forgetting prefill engine %s at %s: %s", gone.engine_id, where, why)
            self._on_evict(gone)
