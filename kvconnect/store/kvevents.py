"""vLLM's KV-event wire format, spoken without importing vLLM: the one schema the store
master publishes with (:mod:`kvconnect.store.master.kvevents`) and the router decodes with
(:mod:`kvconnect.router.events`).

A publisher sends each batch as a ZMQ multipart message ``(topic, seq, payload)``: ``seq`` is
8 bytes big-endian, counting from 0 per publisher process; ``payload`` is a msgpack
:class:`KVEventBatch` (an array ``[ts, events, data_parallel_rank]``; each event a map tagged
``"type": <class name>``; fields at their default omitted). A subscriber that missed batches
asks the publisher's ROUTER socket for them: a DEALER sends ``[b"", start_seq]`` and is
answered ``[b"", topic, seq, payload]`` per batch still buffered from ``start_seq`` on, then
``[b"", b"", END_SEQ, b""]`` (vLLM before 0.32 answered without the topic frame, which
:func:`parse_replay` accepts too). The field names, their order, which have defaults, and
these frames are vLLM 0.32's and 0.33's (``vllm/distributed/kv_events.py``; 0.33 added
``BlockStored.lookahead_token_ids``, which 0.32 ignores when decoding).

Decoding is tolerant where vLLM may grow: unknown fields of a known event are ignored, and an
event of an unknown type is skipped (counted) rather than failing its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

BlockHash = bytes | int
"""A block hash as vLLM publishes it: bytes (its default), or a 64-bit int with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"
OWNERSHIP_KVCONNECT = "kvconnect"
"""``ownership`` of every event about kvconnect's store tier (the master's and the vLLM
connector's pool events alike)."""

SEQ_BYTES = 8
END_SEQ = -1
"""The sequence number that ends a replay answer."""


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False, frozen=True):
    """Blocks now held: ``block_hashes`` consecutive blocks of a prefix after
    ``parent_block_hash`` (None: the first block, or unknown), ``token_ids`` all their tokens
    (empty when the publisher does not know them)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None  # vLLM 0.33 on


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False, frozen=True):
    """Blocks no longer held in ``medium``."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False, frozen=True):
    """Everything the publisher announced before is gone."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: ``ts`` wall-clock seconds, the events in order."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _Envelope(msgspec.Struct, array_like=True, gc=False):
    """A batch with its events still encoded (each decoded on its own, see module doc)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded payload: the batch of the events understood, and how many were skipped."""

    batch: KVEventBatch
    skipped: int


_envelope = msgspec.msgpack.Decoder(_Envelope)
_event = msgspec.msgpack.Decoder(KVEvent)
_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    """The payload of ``batch``."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> Decoded:
    """Decode a payload; raises :class:`msgspec.DecodeError` (a ValueError) when it is not a
    batch at all. Events of unknown types, or malformed ones, are skipped and counted."""
    envelope = _envelope.decode(payload)
    events: list[KVEvent] = []
    skipped = 0
    for raw in envelope.events:
        try:
            events.append(_event.decode(raw))
        except msgspec.DecodeError:
            skipped += 1
    return Decoded(KVEventBatch(envelope.ts, events, envelope.data_parallel_rank), skipped)


def encode_seq(seq: int) -> bytes:
    """``seq`` (0 ≤ seq < 2**63, or :data:`END_SEQ`) as 8 bytes big-endian."""
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_seq(frame: bytes) -> int | None:
    """The sequence number in ``frame`` (:data:`END_SEQ` for the end marker), or None when
    the frame is not 8 bytes."""
    if len(frame) != SEQ_BYTES:
        return None
    return int.from_bytes(frame, "big", signed=True)


def parse_published(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of a PUB message ``(topic, seq, payload)``, or None when it is not
    one (wrong frame count, seq not 8 bytes or negative)."""
    if len(frames) != 3:
        return None
    seq = decode_seq(frames[1])
    if seq is None or seq < 0:
        return None
    return seq, frames[2]


def replay_request(start: int) -> list[bytes]:
    """The frames a DEALER sends to ask for the batches from ``start`` on."""
    return [b"", encode_seq(start)]


def parse_replay(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of one replay answer as a DEALER receives it (``seq`` is
    :data:`END_SEQ` at the end), or None when the frames are not an answer."""
    if len(frames) == 4 and frames[0] == b"":  # vLLM 0.32 on: [b"", topic, seq, payload]
        seq_frame, payload = frames[2], frames[3]
    elif len(frames) == 3 and frames[0] == b"":  # before: [b"", seq, payload]
        seq_frame, payload = frames[1], frames[2]
    else:
        return None
    seq = decode_seq(seq_frame)
    if seq is None or seq < END_SEQ:
        return None
    return seq, payload


def replay_answer(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The frames (after the peer's identity) a ROUTER answers with for one batch; the end
    marker is ``replay_answer(b"", END_SEQ, b"")``."""
    return [b"", topic, encode_seq(seq), payload]
