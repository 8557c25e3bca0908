"""One hop of a request to one instance, and its retries on others while it has not started.

A hop *has not started* until the first byte of the instance's answer reached the router: a
connection refused, reset or closed before that, or a 5xx answer, is retried on another
instance of the same role (at most ``max_attempts`` instances in all); a connection failure
also takes the instance out of the fleet. A hop whose answer started relaying to the client
is never retried: if the instance breaks mid-answer, the client's connection is closed. A hop
that times out (``request_timeout``) is answered 504 and not retried (the instance may still
be computing it).

Runs on the router's event loop.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from aiohttp import web

from kvconnect.errors import ProtocolError
from kvconnect.router.instances import Fleet
from kvconnect.router.metrics import Outcome, RouterMetrics
from kvconnect.router.types import Choice, Role
from kvconnect.router.upstream import read_limited

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_EVENT = b"data:"  # a server-sent event's field (vLLM streams one event per chunk of tokens)

Chooser = Callable[[set[str]], Choice | None]
"""The next instance for a retry, excluding the URLs already tried (None: no more)."""


class NotStarted(Exception):
    """The hop failed before any answer byte: another instance may take it."""

    def __init__(self, message: str, *, unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable  # the instance could not be reached: take it out


class Failed(Exception):
    """The request failed for good: answer the client ``status`` with an error saying
    ``message``, or with ``body`` as it is (an instance's own refusal)."""

    def __init__(
        self,
        status: int,
        message: str,
        outcome: Outcome,
        *,
        body: bytes | None = None,
        content_type: str = "application/json",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.outcome = outcome
        self.body = body
        self.content_type = content_type

    def response(self) -> web.Response:
        """The answer to the client."""
        if self.body is None:
            return error(self.status, self.message)
        return web.Response(status=self.status, body=self.body, content_type=self.content_type)


@dataclass(frozen=True, slots=True)
class Hop:
    """What is sent: ``body`` (JSON bytes) to ``path`` with ``headers``, counting ``tokens``
    uncached prompt tokens in flight at the instance until its first answer byte."""

    path: str
    body: bytes
    headers: Mapping[str, str]
    tokens: int


def error(status: int, message: str, kind: str = "router_error") -> web.Response:
    """An OpenAI-style error answer."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


class Relay:
    """Sends hops through ``session`` with ``timeout``; see the module docstring."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        fleet: Fleet,
        metrics: RouterMetrics,
        *,
        timeout: aiohttp.ClientTimeout,
        max_attempts: int,
    ) -> None:
        self._session = session
        self._fleet = fleet
        self._metrics = metrics
        self._timeout = timeout
        self._max_attempts = max_attempts

    async def attempts(
        self,
        first: Choice,
        choose: Chooser,
        role: Role,
        send: Callable[[Choice], Awaitable[_T]],
    ) -> tuple[Choice, _T]:
        """``send`` at ``first``, then at the instances ``choose`` gives while a try raises
        NotStarted; the choice that worked and what ``send`` returned. Raises Failed (503)
        when every try failed to start, or whatever Failed ``send`` raised."""
        tried: set[str] = set()
        choice: Choice | None = first
        reason = "no instance"
        while choice is not None and len(tried) < self._max_attempts:
            tried.add(choice.instance)
            try:
                return choice, await send(choice)
            except NotStarted as exc:
                reason = str(exc)
                log.warning("%s hop to %s did not start: %s", role.value, choice.instance, reason)
                if exc.unreachable:
                    self._fleet.failed(choice.instance, reason)
            choice = choose(tried)
            if choice is not None and len(tried) < self._max_attempts:
                self._metrics.retries.labels(role.value).inc()
        raise Failed(
            503, f"no {role.value} instance could take the request: {reason}", Outcome.UNAVAILABLE
        )

    async def call(self, choice: Choice, hop: Hop) -> tuple[int, str, bytes]:
        """The whole (buffered) answer of one hop: status, content type, body."""
        with self._fleet.begin(choice.instance, hop.tokens), _before_answer(choice):
            async with self._post(choice, hop) as reply:
                if reply.status >= 500:
                    raise NotStarted(f"answered {reply.status}", unreachable=False)
                try:
                    body = await read_limited(reply)
                except ProtocolError as exc:
                    raise Failed(502, str(exc), Outcome.UPSTREAM_ERROR) from exc
                return reply.status, reply.content_type, body

    async def stream(
        self,
        client: web.Request,
        choice: Choice,
        hop: Hop,
        started: Callable[[float], None],
        finished: Callable[[float, int], None],
    ) -> tuple[web.StreamResponse, Outcome]:
        """Relay one hop's answer to ``client`` chunk by chunk as it arrives. For a streamed
        answer (server-sent events), ``started`` gets the seconds to its first byte (about the
        TTFT), and ``finished`` the seconds from there to its end and its number of events,
        once relayed whole. Raises NotStarted or Failed before the first byte; after it, the
        outcome says whether the answer was relayed whole."""
        with self._fleet.begin(choice.instance, hop.tokens) as ticket:
            begun = time.monotonic()
            with _before_answer(choice):
                reply = await self._post(choice, hop)
            async with reply:
                with _before_answer(choice):
                    if reply.status >= 500:
                        raise NotStarted(f"answered {reply.status}", unreachable=False)
                    first = await reply.content.readany()
                    if not first and reply.status == 200:
                        raise NotStarted("closed before answering", unreachable=True)
                ticket.prefilled()
                streamed = reply.content_type == "text/event-stream"
                if streamed:
                    started(time.monotonic() - begun)
                begun = time.monotonic()
                out, outcome, events = await self._relay(client, reply, first, choice)
                if streamed and outcome is Outcome.OK:
                    finished(time.monotonic() - begun, events)
                return out, outcome

    async def _relay(
        self, client: web.Request, reply: aiohttp.ClientResponse, first: bytes, choice: Choice
    ) -> tuple[web.StreamResponse, Outcome, int]:
        """From the first byte on: whatever breaks ends the client's answer, never a retry.
        Also counts the server-sent events relayed (``data:`` fields)."""
        out = web.StreamResponse(status=reply.status)
        out.content_type = reply.content_type
        if reply.charset:
            out.charset = reply.charset
        events = first.count(_EVENT)
        try:
            await out.prepare(client)
            await out.write(first)
            async for chunk in reply.content.iter_any():
                events += chunk.count(_EVENT)
                await out.write(chunk)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            transport = client.transport
            if transport is None or transport.is_closing():
                log.info("the client of a request to %s went away", choice.instance)
                return out, Outcome.ABORTED, events
            log.warning("%s broke while answering: %r", choice.instance, exc)
            transport.close()  # the client sees a truncated answer, not a clean end
            return out, Outcome.UPSTREAM_ERROR, events
        await out.write_eof()
        return out, outcome_of(reply.status), events

    def _post(self, choice: Choice, hop: Hop) -> aiohttp.client._RequestContextManager:
        headers = {**hop.headers, "Content-Type": "application/json"}
        return self._session.post(
            choice.instance + hop.path, data=hop.body, headers=headers, timeout=self._timeout
        )


@contextlib.contextmanager
def _before_answer(choice: Choice) -> Iterator[None]:
    """What failing before the first answer byte means: a connect timeout or any connection
    or protocol error did not start the hop; a timeout after connecting is final (504)."""
    try:
        yield
    except aiohttp.ConnectionTimeoutError as exc:
        raise NotStarted(repr(exc), unreachable=True) from exc
    except TimeoutError as exc:
        raise Failed(504, f"{choice.instance} timed out", Outcome.TIMEOUT) from exc
    except aiohttp.ClientError as exc:
        raise NotStarted(repr(exc), unreachable=True) from exc


def outcome_of(status: int) -> Outcome:
    """The outcome of a request answered ``status`` by an instance."""
    if status == 200:
        return Outcome.OK
    return Outcome.CLIENT_ERROR if status < 500 else Outcome.UPSTREAM_ERROR
