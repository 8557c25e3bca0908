"""The router's calls to one vLLM instance over HTTP: health, load, tokens, JSON replies.

Every call has a timeout and reads at most a bounded number of bytes. Failures to reach the
instance raise :class:`~kvconnect.errors.PeerUnreachable` (connection refused or reset,
timeout): the caller may take the instance out and retry elsewhere. A reply that is not what
vLLM sends raises :class:`~kvconnect.errors.ProtocolError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from kvconnect.errors import PeerUnreachable, ProtocolError
from kvconnect.router.load import parse_load
from kvconnect.router.types import Load

MAX_REPLY_BYTES = 64 * 1024 * 1024
"""Largest upstream body the router buffers (prefill and non-streamed replies, /metrics)."""

CONNECTION_ERRORS = (aiohttp.ClientError, TimeoutError)
"""What an unreachable, dead, hung or garbage-speaking instance raises from aiohttp."""


async def read_limited(reply: aiohttp.ClientResponse, limit: int = MAX_REPLY_BYTES) -> bytes:
    """The body of ``reply``; ProtocolError when it exceeds ``limit`` bytes."""
    if reply.content_length is not None and reply.content_length > limit:
        raise ProtocolError(f"{reply.url}: reply of {reply.content_length} bytes (> {limit})")
    chunks: list[bytes] = []
    size = 0
    async for chunk in reply.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise ProtocolError(f"{reply.url}: reply larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def check(session: aiohttp.ClientSession, url: str, timeout: float) -> Load:
    """One health check: ``/health`` must answer 200, then ``/metrics`` gives the load.

    Raises PeerUnreachable (no answer within ``timeout`` seconds, or not 200) or
    ProtocolError (``/metrics`` is not Prometheus text)."""
    limits = aiohttp.ClientTimeout(total=timeout)
    try:
        async with session.get(url + "/health", timeout=limits) as reply:
            await read_limited(reply, 1 << 16)
            if reply.status != 200:
                raise PeerUnreachable(f"{url}/health answered {reply.status}")
        async with session.get(url + "/metrics", timeout=limits) as reply:
            body = await read_limited(reply)
            if reply.status != 200:
                raise PeerUnreachable(f"{url}/metrics answered {reply.status}")
    except CONNECTION_ERRORS as exc:
        raise PeerUnreachable(f"{url}: {exc!r}") from exc
    return parse_load(body.decode("utf-8", errors="replace"))


async def tokenize(
    session: aiohttp.ClientSession, url: str, payload: Mapping[str, Any], timeout: float
) -> list[int]:
    """The token ids ``url``'s own ``/tokenize`` gives for ``payload`` (vLLM's
    ``{"model", "prompt"}`` or ``{"model", "messages", …}``), chat template included.

    Raises PeerUnreachable or ProtocolError (not 200, or no list of ints)."""
    try:
        async with session.post(
            url + "/tokenize", json=payload, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as reply:
            body = await read_limited(reply)
            status = reply.status
    except CONNECTION_ERRORS as exc:
        raise PeerUnreachable(f"{url}/tokenize: {exc!r}") from exc
    if status != 200:
        raise ProtocolError(f"{url}/tokenize answered {status}: {body[:200]!r}")
    try:
        tokens = json.loads(body)["tokens"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"{url}/tokenize: no tokens in the reply") from exc
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ProtocolError(f"{url}/tokenize: tokens is not a list of integers")
    return tokens
