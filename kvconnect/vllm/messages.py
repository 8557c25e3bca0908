"""The prefill side channel's wire schemas (msgspec msgpack, versioned; never pickle).

Decode (its scheduler and workers) calls prefill's side channel: once per prefill engine for
the layout of its KV cache, then per request to renew leases, confirm reads, or give blocks
up. Every message is one request and one reply.
"""

from __future__ import annotations

from typing import Final

import msgspec

from kvconnect.vllm.layout import RankLayout

PROTOCOL_VERSION: Final = 3  # 2: layouts carry their KVFormat; 3: their heads, readers
MAX_READERS: Final = 1024
"""Most decode ranks a confirmation may name (a bound on hostile input)."""


class GetLayout(msgspec.Struct, tag="layout", frozen=True):
    """The layouts of every TP rank of the prefill engine."""


class Renew(msgspec.Struct, tag="renew", frozen=True):
    """Decode still wants these prefill requests' blocks: extend their leases."""

    request_ids: list[str]


class Confirm(msgspec.Struct, tag="confirm", frozen=True):
    """Decode TP rank ``reader`` of ``readers`` finished reading ``request_id``'s blocks
    (from every prefill rank it needed); prefill frees them once all ``readers`` did."""

    request_id: str
    reader: int
    readers: int = 1


class GiveUp(msgspec.Struct, tag="give_up", frozen=True):
    """Decode will not read these requests' blocks: free them now."""

    request_ids: list[str]


Request = GetLayout | Renew | Confirm | GiveUp


class LayoutReply(msgspec.Struct, tag="layout_reply", frozen=True):
    engine_id: str
    ranks: dict[int, RankLayout]


class Ack(msgspec.Struct, tag="ack", frozen=True):
    """``ok`` False: refused (e.g. a read confirmed after its lease lapsed), see ``error``."""

    ok: bool
    error: str = ""


Reply = LayoutReply | Ack


class Envelope(msgspec.Struct, array_like=True, frozen=True):
    version: int
    call: int
    body: Request


class ReplyEnvelope(msgspec.Struct, array_like=True, frozen=True):
    version: int
    call: int
    body: Reply
