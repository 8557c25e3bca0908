"""KV events of the store: the wire schema (tolerant decoding, frames), pool keys as block
hashes, and the master's publisher on real sockets (replay, hostile replay requests, a full
queue). vLLM's own classes are checked against this schema in tests/router/test_events_vllm.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvconnect.store.kvevents import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    encode_seq,
    parse_published,
    parse_replay,
    replay_request,
)
from kvconnect.store.launch import free_port
from kvconnect.store.master.kvevents import (
    KvEventPublisher,
    key_hash,
    removed_events,
    stored_event,
)
from kvconnect.vllm.pool import pool_keys
from tests.support.waiting import wait_for

HASH = bytes(range(32))


def _stored(*hashes: bytes | int) -> BlockStored:
    return BlockStored(list(hashes), None, [1, 2], 2, None, "GPU", None)


def test_a_batch_round_trips_and_omits_defaults() -> None:
    batch = KVEventBatch(1.5, [_stored(HASH, 7), BlockRemoved([HASH], "GPU"), AllBlocksCleared()])
    payload = encode_batch(batch)
    decoded = decode_batch(payload)
    assert decoded.batch == batch
    assert decoded.skipped == 0
    event = msgspec.msgpack.decode(payload)[1][0]
    assert event["type"] == "BlockStored"
    assert "group_idx" not in event, "fields at their default are omitted, as vLLM does"
    assert event["lora_id"] is None, "fields without a default are always written"


def test_decoding_tolerates_unknown_fields_and_event_types() -> None:
    raw = [
        2.0,
        [
            {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "future": [1]},
            {"type": "BlockMoved", "block_hashes": [5]},
            {"type": "BlockStored", "block_hashes": "not a list"},
            {"type": "AllBlocksCleared"},
        ],
        0,
        "a field vLLM may append",
    ]
    decoded = decode_batch(msgspec.msgpack.encode(raw))
    assert decoded.batch == KVEventBatch(2.0, [BlockRemoved([5], "GPU"), AllBlocksCleared()], 0)
    assert decoded.skipped == 2


@pytest.mark.parametrize(
    "payload", [b"", b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0, 3])]
)
def test_a_payload_that_is_no_batch_raises_a_decode_error(payload: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_batch(payload)


def test_frames_of_the_stream_and_of_replays() -> None:
    assert encode_seq(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    assert encode_seq(END_SEQ) == b"\xff" * 8
    assert parse_published([b"t", encode_seq(3), b"p"]) == (3, b"p")
    assert parse_published([b"t", b"\x01", b"p"]) is None
    assert parse_published([b"t", encode_seq(END_SEQ), b"p"]) is None
    assert parse_published([encode_seq(3), b"p"]) is None
    assert replay_request(9) == [b"", encode_seq(9)]
    assert parse_replay([b"", b"t", encode_seq(4), b"p"]) == (4, b"p")
    assert parse_replay([b"", encode_seq(4), b"p"]) == (4, b"p"), "vLLM before 0.32"
    assert parse_replay([b"", b"", encode_seq(END_SEQ), b""]) == (END_SEQ, b"")
    assert parse_replay([b"x", b"t", encode_seq(4), b"p"]) is None
    assert parse_replay([b"", b"t", b"short", b"p"]) is None
    assert parse_replay([b"", b"t", encode_seq(-2), b"p"]) is None


def test_pool_keys_are_published_as_their_block_hash_and_group() -> None:
    keys = pool_keys(namespace="team/a", model="org/model", compat="c0ffee" * 8)
    assert key_hash(keys.block_key(HASH.hex(), 3)) == (HASH, 3)
    assert key_hash(pool_keys(namespace="", model="m", compat="ab").block_key("00ff")) == (
        b"\x00\xff",
        0,
    )
    assert key_hash(keys.probe_key) is None
    for other in ["sglang/abc/0", "vllm/m/c/0f/g", "vllm/m/c/0g/g0", "vllm/m/c/abc/g0", "x/00/g0"]:
        assert key_hash(other) is None, other
    assert key_hash("vllm/m/c/ABCD/g0") is None, "pool keys hold lower-case hex"


def test_events_of_store_keys() -> None:
    keys = pool_keys(namespace="", model="m", compat="ab")
    event = stored_event(keys.block_key(HASH.hex(), 1))
    assert (event.block_hashes, event.group_idx, event.token_ids) == ([HASH], 1, [])
    assert (event.medium, event.locality, event.ownership) == ("CPU", "REMOTE", "kvconnect")
    assert stored_event("app/key").block_hashes == [b"app/key"]
    assert stored_event("app/key").group_idx is None
    removed = removed_events(
        [keys.block_key("01"), "app/key", keys.block_key("02"), keys.block_key("03", 1)]
    )
    assert [(e.group_idx, e.block_hashes) for e in removed] == [
        (0, [b"\x01", b"\x02"]),
        (None, [b"app/key"]),
        (1, [b"\x03"]),
    ]


@pytest.fixture
def publisher() -> Iterator[KvEventPublisher]:
    port, replay = free_port(), free_port()
    with KvEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", 4) as pub:
        yield pub


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    return sock


def _replay(sock: zmq.Socket[bytes], start: int) -> list[tuple[int, bytes]]:
    sock.send_multipart(replay_request(start))
    answers = []
    while True:
        answer = parse_replay(sock.recv_multipart())
        assert answer is not None
        if answer[0] == END_SEQ:
            return answers
        answers.append(answer)


def _published(pub: KvEventPublisher, count: int) -> None:
    wait_for(lambda: pub.stats.published >= count, "the publisher thread sends the batches")


@pytest.mark.parametrize(
    "hostile",
    [
        [b"garbage"],
        [b"", b"\x01\x02"],
        [b"", encode_seq(0), b"extra"],
        [b"not empty", encode_seq(0)],
        [b"", b"x" * 200],  # past the ROUTER's message size: the peer is disconnected
    ],
)
def test_replays_answer_from_the_ring_and_ignore_hostile_requests(
    publisher: KvEventPublisher, hostile: list[bytes], ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    for i in range(6):
        publisher.publish([BlockRemoved([i], "CPU")])
    _published(publisher, 6)
    assert publisher.replay_endpoint is not None
    bad = _dealer(ctx, publisher.replay_endpoint)
    good = _dealer(ctx, publisher.replay_endpoint)
    try:
        bad.send_multipart(hostile)
        answers = _replay(good, 0)
        assert [seq for seq, _ in answers] == [2, 3, 4, 5], "the ring keeps the last 4"
        hashes = [decode_batch(p).batch.events[0] for _, p in answers]
        assert hashes == [BlockRemoved([i], "CPU") for i in range(2, 6)]
        assert _replay(good, 2**63 - 1) == [], "a seq past the end: only the end marker"
        assert _replay(good, 5) == answers[-1:]
        if len(hostile[-1]) <= 64:  # (a bigger one never reaches the publisher)
            wait_for(lambda: publisher.stats.bad_requests == 1, "the hostile request is counted")
    finally:
        bad.close()
        good.close()


def test_a_full_queue_drops_batches_and_counts_them() -> None:
    pub = KvEventPublisher(f"tcp://127.0.0.1:{free_port()}", None, 4, size=2)
    for i in range(5):  # not started: nothing drains the queue
        pub.publish([BlockRemoved([i], "CPU")])
    assert pub.stats.dropped == 3
    pub.close()


def test_a_publisher_that_cannot_bind_raises() -> None:
    with KvEventPublisher(f"tcp://127.0.0.1:{free_port()}", None, 4) as first:
        second = KvEventPublisher(first.endpoint, None, 4)
        with pytest.raises(zmq.ZMQError):
            second.start()
        second.close()
