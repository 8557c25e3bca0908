"""The master channel: the server's state machine fed by hand, and RpcServer/RpcClient over
real sockets in one process (hostile peers, timeouts, restarts)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvconnect.bench.master_load import mount_virtual
from kvconnect.errors import AuthenticationError, ClosedError, MasterUnavailable, ProtocolError
from kvconnect.store import channel as ch
from kvconnect.store import messages as m
from kvconnect.store.config import MasterConfig
from kvconnect.store.master.service import MasterService
from kvconnect.store.rpc import RpcClient, RpcServer
from kvconnect.transfer.protocol import wire
from tests.support.cpu import thread_cpu
from tests.support.master_wire import hostile_hello, read_until_closed
from tests.support.waiting import wait_for

TOKEN = "the-cluster-token"
SERVER_ID = b"S" * 16


class _Client:
    """The client side of the handshake, by hand (what ClientChannel does over a socket)."""

    def __init__(self, token: str | None, version: int = ch.VERSION) -> None:
        self.token = token
        self.nonce = os.urandom(wire.NONCE_LEN)
        flags = wire.FLAG_TOKEN if token else 0
        self.hello = wire.HELLO.pack(ch.MAGIC, version, flags, self.nonce)
        self.send: ch._Seal
        self.receive: ch._Seal

    def proof(self, server_hello: bytes, token: str | None = None) -> bytes:
        _magic, _version, _flags, server_nonce, _id = wire.SERVER_HELLO.unpack(server_hello)
        self.send, self.receive = ch._seals(self.token, self.nonce, server_nonce)
        return wire.token_mac(token or self.token or "", b"client", server_nonce, self.nonce)


def _open(token: str | None) -> tuple[ch.ServerSession, _Client]:
    session = ch.ServerSession(token, SERVER_ID, 1024)
    client = _Client(token)
    assert session.receive(client.hello) == []
    server_hello = session.take_output()
    if token is None:
        client.proof(server_hello)
    else:
        assert session.receive(client.proof(server_hello)) == []
        reply = session.take_output()
        assert reply[:1] == b"\x00"
        _magic, _v, _f, server_nonce, _id = wire.SERVER_HELLO.unpack(server_hello)
        assert reply[1:] == wire.token_mac(token, b"server", client.nonce, server_nonce)
    assert session.phase is ch.Phase.OPEN
    return session, client


@pytest.mark.parametrize("token", [None, TOKEN])
def test_frames_arrive_whole_and_in_order_however_the_bytes_are_cut(token: str | None) -> None:
    session, client = _open(token)
    messages = [b"first", b"", os.urandom(700)]
    stream = b"".join(ch.frame(client.send, message) for message in messages)
    received: list[bytes] = []
    for i in range(len(stream)):  # one byte at a time
        received += session.receive(stream[i : i + 1])
    assert received == messages
    session.send(b"answer")
    out = session.take_output()
    (size,) = ch.LENGTH.unpack_from(out)
    assert client.receive.open(out[ch.LENGTH.size : ch.LENGTH.size + size]) == b"answer"
    if token is not None:
        assert b"answer" not in out  # sealed


def test_a_wrong_token_is_refused_with_a_status_and_never_opens() -> None:
    session = ch.ServerSession(TOKEN, SERVER_ID, 1024)
    client = _Client(TOKEN)
    session.receive(client.hello)
    server_hello = session.take_output()
    with pytest.raises(AuthenticationError, match="prove"):
        session.receive(client.proof(server_hello, token="a-guess"))
    assert session.take_output() == b"\x01"
    assert session.phase is not ch.Phase.OPEN


def test_a_client_proving_a_tenants_token_is_that_tenant_and_sealed_with_its_token() -> None:
    tenants = {"tenant-a-token": "a", "tenant-b-token": "b"}
    for token, expected in ((TOKEN, None), ("tenant-a-token", "a"), ("tenant-b-token", "b")):
        session = ch.ServerSession(TOKEN, SERVER_ID, 1024, tenants)
        client = _Client(token)
        session.receive(client.hello)
        session.receive(client.proof(session.take_output()))
        assert session.take_output()[:1] == b"\x00"
        assert (session.phase, session.tenant) == (ch.Phase.OPEN, expected)
        session.receive(ch.frame(client.send, b"hello"))  # sealed with the tenant's token
        assert session.receive(ch.frame(client.send, b"next")) == [b"next"]
    session = ch.ServerSession(TOKEN, SERVER_ID, 1024, tenants)
    client = _Client("tenant-c-token")  # not a tenant of this master
    session.receive(client.hello)
    with pytest.raises(AuthenticationError):
        session.receive(client.proof(session.take_output()))


@pytest.mark.parametrize(("server", "client"), [(TOKEN, None), (None, TOKEN)])
def test_token_and_plain_do_not_mix(server: str | None, client: str | None) -> None:
    session = ch.ServerSession(server, SERVER_ID, 1024)
    with pytest.raises(AuthenticationError):
        session.receive(_Client(client).hello)
    _magic, _version, flags, _nonce, _id = wire.SERVER_HELLO.unpack(session.take_output())
    assert bool(flags & wire.FLAG_TOKEN) == bool(server)  # the client learns why


def test_another_version_or_protocol_is_refused() -> None:
    session = ch.ServerSession(None, SERVER_ID, 1024)
    with pytest.raises(ProtocolError, match="protocol 2"):
        session.receive(_Client(None, version=2).hello)
    _magic, version, _f, _n, _id = wire.SERVER_HELLO.unpack(session.take_output())
    assert version == ch.VERSION
    transfer_hello = wire.HELLO.pack(wire.MAGIC, wire.PROTOCOL_VERSION, 0, bytes(16))
    with pytest.raises(ProtocolError, match="not a store master client"):
        ch.ServerSession(None, SERVER_ID, 1024).receive(transfer_hello)


def test_an_oversized_frame_ends_the_connection_before_its_body() -> None:
    session, _client = _open(None)
    with pytest.raises(ProtocolError, match="1025 bytes"):
        session.receive(ch.LENGTH.pack(1025))


def test_altered_replayed_and_reordered_frames_fail_to_open() -> None:
    session, client = _open(TOKEN)
    first = ch.frame(client.send, b"first")
    assert session.receive(first) == [b"first"]
    with pytest.raises(ProtocolError, match="authentication"):
        session.receive(first)  # the same frame again
    session, client = _open(TOKEN)
    one, two = ch.frame(client.send, b"one"), ch.frame(client.send, b"two")
    with pytest.raises(ProtocolError):
        session.receive(two + one)
    session, client = _open(TOKEN)
    altered = bytearray(ch.frame(client.send, b"payload"))
    altered[-1] ^= 1
    with pytest.raises(ProtocolError):
        session.receive(bytes(altered))


# ------------------------------------------------------------------ over real sockets


class _Master:
    """An RpcServer on a thread whose handler echoes Exists and sleeps on Remove."""

    def __init__(self, token: str | None, port: int = 0, poll_window: float = 0.0) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.server = RpcServer(
            f"tcp://127.0.0.1:{port}",
            self._handle,
            lambda: 0.05,
            token=token,
            max_message_bytes=1 << 16,
            poll_window=poll_window,
        )
        self.endpoint = self.server.bind()
        self.thread = threading.Thread(target=self.server.serve)
        self.thread.start()

    def _handle(self, request: m.Request, tenant: str | None) -> m.Reply:
        assert tenant is None
        if isinstance(request, m.Remove):
            self.entered.set()
            self.release.wait(10)
            return m.CodesReply([m.Code.OK])
        assert isinstance(request, m.Exists)
        return m.ExistsReply([key.startswith("yes") for key in request.keys])

    def close(self) -> None:
        self.release.set()
        self.server.stop()
        self.thread.join(10)
        assert self.server.crashed is None


@pytest.fixture
def master() -> Iterator[_Master]:
    server = _Master(TOKEN)
    yield server
    server.close()


def test_calls_from_many_threads_get_their_own_answers(master: _Master) -> None:
    rpc = RpcClient(master.endpoint, 5.0, token=TOKEN)
    errors: list[BaseException] = []

    def caller(n: int) -> None:
        try:
            for i in range(200):
                keys = [f"yes-{n}-{i}", f"no-{n}-{i}"] * (i % 5)
                assert rpc.call(m.Exists(keys)) == m.ExistsReply([True, False] * (i % 5))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert master.server.connections <= len(threads)  # at most one per call at a time
    rpc.close()
    wait_for(lambda: master.server.connections == 0, "the client's connections closed")


def _call_on_a_new_thread(rpc: RpcClient, request: m.Request) -> m.Reply:
    replies: list[m.Reply] = []
    thread = threading.Thread(target=lambda: replies.append(rpc.call(request)))
    thread.start()
    thread.join(10)
    (reply,) = replies
    return reply


def test_threads_that_come_and_go_share_one_idle_connection(master: _Master) -> None:
    """A thread that ends leaves its connection to the next caller: short-lived threads
    (vLLM's lanes end after idling) neither leak connections nor each pay a handshake."""
    rpc = RpcClient(master.endpoint, 5.0, token=TOKEN)
    for n in range(20):
        reply = _call_on_a_new_thread(rpc, m.Exists([f"yes-{n}", f"no-{n}"]))
        assert reply == m.ExistsReply([True, False])
    assert master.server.connections == 1
    rpc.close()
    wait_for(lambda: master.server.connections == 0, "the client's connection closed")


def test_connect_opens_the_connection_the_next_call_takes(master: _Master) -> None:
    rpc = RpcClient(master.endpoint, 5.0, token=TOKEN)
    rpc.connect()
    assert master.server.connections == 1  # handshake done: the master holds it
    assert _call_on_a_new_thread(rpc, m.Exists(["yes"])) == m.ExistsReply([True])
    rpc.connect()  # one is idle: nothing more opens
    assert master.server.connections == 1
    rpc.close()
    with pytest.raises(ClosedError):
        rpc.connect()


def test_a_wrong_or_missing_token_is_a_clear_error(master: _Master) -> None:
    for token in ("not-it", None):
        rpc = RpcClient(master.endpoint, 2.0, token=token)
        with pytest.raises(MasterUnavailable, match="cluster token"):
            rpc.call(m.Exists(["yes"]))
        rpc.close()
    wait_for(lambda: master.server.refused >= 2, "refusals not counted")


def test_a_timed_out_call_cannot_confuse_the_next_one(master: _Master) -> None:
    rpc = RpcClient(master.endpoint, 5.0, token=TOKEN)
    with pytest.raises(MasterUnavailable, match="did not answer Remove in time"):
        rpc.call(m.Remove(["k"], False), timeout=0.2)
    master.release.set()  # its late answer goes to a connection the client closed
    assert rpc.call(m.Exists(["yes", "no"])) == m.ExistsReply([True, False])
    rpc.close()


def test_close_wakes_a_blocked_call(master: _Master) -> None:
    rpc = RpcClient(master.endpoint, 30.0, token=TOKEN)
    assert rpc.call(m.Exists([])) == m.ExistsReply([])
    failures: list[BaseException] = []

    def blocked() -> None:
        try:
            rpc.call(m.Remove(["k"], False))
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    assert master.entered.wait(10)
    rpc.close()
    thread.join(10)
    assert not thread.is_alive()
    assert len(failures) == 1
    assert isinstance(failures[0], ClosedError)


def test_close_fails_a_call_about_to_wait_for_its_reply(
    master: _Master, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close that lands between a call's send and its wait must fail the call too (the
    descriptor it is about to wait on stays valid until the call lets go of it)."""
    sent, closed = threading.Event(), threading.Event()
    receive = ch.ClientChannel.receive

    def paused(channel: ch.ClientChannel, deadline: float) -> bytes:
        sent.set()
        closed.wait(10)
        return receive(channel, deadline)

    monkeypatch.setattr(ch.ClientChannel, "receive", paused)
    rpc = RpcClient(master.endpoint, 30.0, token=TOKEN)
    failures: list[BaseException] = []

    def caller() -> None:
        try:
            rpc.call(m.Remove(["k"], False))  # answered only once released: no reply waits
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    assert sent.wait(10)
    assert master.entered.wait(10)
    rpc.close()
    closed.set()
    thread.join(10)
    assert not thread.is_alive()
    assert [type(exc) for exc in failures] == [ClosedError]
    master.release.set()  # the master's loop goes on (and sees the connection gone)
    wait_for(lambda: master.server.connections == 0, "the caller closed its connection")


def test_a_restarted_master_is_reached_on_the_next_call() -> None:
    first = _Master(TOKEN)
    rpc = RpcClient(first.endpoint, 5.0, token=TOKEN)
    assert rpc.call(m.Exists(["yes"])) == m.ExistsReply([True])
    port = int(first.endpoint.rsplit(":", 1)[1])
    first.close()
    second = _Master(TOKEN, port)
    try:
        assert rpc.call(m.Exists(["no", "yes"])) == m.ExistsReply([False, True])
    finally:
        rpc.close()
        second.close()


def test_a_master_that_is_not_up_yet_is_waited_for_within_the_timeout() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rpc = RpcClient(f"tcp://127.0.0.1:{port}", 0.3, token=TOKEN)
    with pytest.raises(MasterUnavailable, match="not reachable"):
        rpc.call(m.Exists([]))
    with pytest.raises(MasterUnavailable, match="not reachable"):
        rpc.connect()
    replies: list[m.Reply] = []
    caller = threading.Thread(target=lambda: replies.append(rpc.call(m.Exists(["yes"]), 30)))
    caller.start()  # refused until the master below binds
    late = _Master(TOKEN, port)
    caller.join(30)
    rpc.close()
    late.close()
    assert replies == [m.ExistsReply([True])]


def test_idle_and_dripping_handshakes_cannot_crowd_out_clients(master: _Master) -> None:
    address = ch.parse_endpoint(master.endpoint)
    idle = [socket.create_connection(address) for _ in range(300)]
    try:
        wait_for(lambda: master.server.refused >= 300 - 256, "the oldest were not cut")
        rpc = RpcClient(master.endpoint, 5.0, token=TOKEN)
        assert rpc.call(m.Exists(["yes"])) == m.ExistsReply([True])
        dripping = hostile_hello(master.endpoint, flags=wire.FLAG_TOKEN, partial=True)
        assert read_until_closed(dripping, timeout=10) == b""  # cut at the handshake deadline
        assert rpc.call(m.Exists(["yes"])) == m.ExistsReply([True])
        rpc.close()
    finally:
        for sock in idle:
            sock.close()


def test_polling_answers_every_call_and_stops_once_the_master_is_idle() -> None:
    master = _Master(TOKEN, poll_window=0.1)
    rpc = RpcClient(master.endpoint, 5.0, token=TOKEN, poll_window=30.0)
    try:
        for i in range(50):
            keys = [f"yes-{i}", f"no-{i}"]
            assert rpc.call(m.Exists(keys)) == m.ExistsReply([True, False])
        before = thread_cpu([master.thread])
        time.sleep(1.0)  # the span measured: the master polls for 0.1 s of it at most
        assert thread_cpu([master.thread]) - before < 0.3
    finally:
        rpc.close()
        master.close()


def test_a_polling_call_still_ends_at_its_timeout(master: _Master) -> None:
    """A poll window longer than the call's timeout never extends the call."""
    rpc = RpcClient(master.endpoint, 5.0, token=TOKEN, poll_window=30.0)
    start = time.monotonic()
    with pytest.raises(MasterUnavailable, match="did not answer Remove in time"):
        rpc.call(m.Remove(["k"], False), timeout=0.3)
    assert time.monotonic() - start < 5.0
    master.release.set()
    assert rpc.call(m.Exists(["yes"])) == m.ExistsReply([True])
    rpc.close()


def test_the_master_polls_after_small_answers_only() -> None:
    """An answer that starts a transfer of more than a MiB brings its client back only
    milliseconds later: the master sleeps instead of polling (however long its window),
    leaving the CPU to the transfer; after a small answer it polls."""
    config = MasterConfig(listen="tcp://127.0.0.1:0", token=TOKEN, poll_window=30.0)
    service = MasterService(config)
    rpc = RpcClient(service.start(), 5.0, token=TOKEN)
    try:
        mount_virtual(rpc, 1 << 30)
        (thread,) = [t for t in threading.enumerate() if t.name == "kvconnect-master"]
        big = rpc.call(m.PutStart("writer", [m.PutItem("big", 2 << 20)]))
        assert isinstance(big, m.PutStartReply)
        assert big.results[0].code is m.Code.OK
        before = thread_cpu([thread])
        time.sleep(1.0)  # the span measured
        assert thread_cpu([thread]) - before < 0.3  # asleep
        assert rpc.call(m.Exists(["big"])) == m.ExistsReply([False])  # pending: not there yet
        before = thread_cpu([thread])
        time.sleep(1.0)
        assert thread_cpu([thread]) - before > 0.3  # polling for the next request
    finally:
        rpc.close()
        service.close()
