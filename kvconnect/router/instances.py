"""The fleet: every instance's role, health, last load and the router's own in-flight count.

An instance is *in* after a good health check (``/health`` 200 and ``/metrics`` parsed) and
*out* after ``unhealthy_after`` failed checks in a row, or at once when a request could not
reach it (:meth:`Fleet.failed`). Listeners hear every change (the router drops an instance's
prefix-index entries when it goes out). Instances start out until the first check.

Everything here runs on the router's event loop (no locks); listeners are called on it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from kvconnect.errors import PeerUnreachable, ProtocolError
from kvconnect.router import upstream
from kvconnect.router.types import Load, Role

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Instance:
    """One instance as the router last saw it (mutated by the fleet only)."""

    url: str
    role: Role
    healthy: bool = False
    failures: int = 0  # failed checks in a row
    load: Load = field(default_factory=Load)
    inflight: int = 0  # requests the router sent here that have not finished
    inflight_tokens: int = 0  # their uncached prompt tokens not yet prefilled
    started: int = 0  # requests the router ever sent here
    ours_in_load: int = 0
    """The router's requests that were in flight here at some moment of the scrape ``load``
    came from: its ``waiting`` may count them, finished since or not."""


class Ticket:
    """One request's share of an instance's in-flight counts, from :meth:`Fleet.begin` until
    :meth:`close` (idempotent; also a context manager)."""

    def __init__(self, instance: Instance, tokens: int) -> None:
        self._instance = instance
        self._tokens = tokens
        self._open = True
        instance.inflight += 1
        instance.inflight_tokens += tokens
        instance.started += 1

    def prefilled(self) -> None:
        """The prompt is computed: its tokens no longer wait (the request still runs)."""
        self._instance.inflight_tokens -= self._tokens
        self._tokens = 0

    def close(self) -> None:
        """The request finished here (in any way)."""
        if self._open:
            self._open = False
            self.prefilled()
            self._instance.inflight -= 1

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


Listener = Callable[[Instance], None]
"""Called with an instance whose ``healthy`` just changed."""


class Fleet:
    """The instances of ``roles`` (URL → role), checked every ``interval`` seconds through
    ``session`` with ``timeout`` seconds per check. :meth:`start` runs the first round of
    checks, then the loop; :meth:`close` stops it (the session is the caller's)."""

    def __init__(
        self,
        roles: Mapping[str, Role],
        session: aiohttp.ClientSession,
        *,
        interval: float,
        timeout: float,
        unhealthy_after: int,
        listeners: Sequence[Listener] = (),
    ) -> None:
        self._instances = {url: Instance(url, role) for url, role in roles.items()}
        self._session = session
        self._interval = interval
        self._timeout = timeout
        self._unhealthy_after = unhealthy_after
        self._listeners = list(listeners)
        self._task: asyncio.Task[None] | None = None

    def listen(self, listener: Listener) -> None:
        """Add a listener of health changes."""
        self._listeners.append(listener)

    async def start(self) -> None:
        """Check every instance once, then keep checking in a task of the running loop."""
        await self.check_all()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="router-health")

    async def close(self) -> None:
        """Stop the health loop (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def instances(self) -> list[Instance]:
        """Every instance, in or out."""
        return list(self._instances.values())

    def get(self, url: str) -> Instance:
        """The instance named ``url`` (KeyError if none)."""
        return self._instances[url]

    def healthy(self, *roles: Role) -> list[Instance]:
        """The instances in, of any of ``roles``."""
        return [i for i in self._instances.values() if i.healthy and i.role in roles]

    def ready(self) -> bool:
        """Whether a request can be served: a unified instance, or a prefill and a decode."""
        roles = {i.role for i in self._instances.values() if i.healthy}
        return Role.UNIFIED in roles or {Role.PREFILL, Role.DECODE} <= roles

    def begin(self, url: str, tokens: int) -> Ticket:
        """Count a request (with ``tokens`` uncached prompt tokens) in flight at ``url``."""
        return Ticket(self._instances[url], tokens)

    def failed(self, url: str, reason: str) -> None:
        """A request could not reach ``url``: take it out now (back after a good check)."""
        instance = self._instances[url]
        instance.failures = max(instance.failures, self._unhealthy_after)
        self._set(instance, healthy=False, reason=reason)

    async def check_all(self) -> None:
        """One health check of every instance, concurrently."""
        await asyncio.gather(*(self._check(i) for i in self._instances.values()))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.check_all()
            except Exception:  # a listener's bug must not end health checking
                log.exception("health check round failed")

    async def _check(self, instance: Instance) -> None:
        inflight, started = instance.inflight, instance.started
        try:
            instance.load = await upstream.check(self._session, instance.url, self._timeout)
        except (PeerUnreachable, ProtocolError) as exc:
            instance.failures += 1
            if instance.failures >= self._unhealthy_after:
                self._set(instance, healthy=False, reason=str(exc))
            return
        instance.ours_in_load = inflight + instance.started - started
        instance.failures = 0
        self._set(instance, healthy=True, reason="health check passed")

    def _set(self, instance: Instance, *, healthy: bool, reason: str) -> None:
        if instance.healthy == healthy:
            return
        instance.healthy = healthy
        if healthy:
            log.info("%s (%s) is in: %s", instance.url, instance.role.value, reason)
        else:
            log.warning("%s (%s) is out: %s", instance.url, instance.role.value, reason)
        for listener in self._listeners:
            listener(instance)
