"""The master's RPC port under hostile input and without the cluster token (real processes)."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvconnect._config import MiB, cluster_token
from kvconnect.errors import MasterUnavailable
from kvconnect.store import channel as ch
from kvconnect.store import messages as m
from kvconnect.store.channel import ClientChannel
from kvconnect.store.client import StoreClient
from kvconnect.store.commands import EXIT_CRASHED
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster, Process, free_port
from kvconnect.store.rpc import RpcClient
from kvconnect.testing.peer import pattern
from kvconnect.transfer import TransferConfig
from kvconnect.transfer.protocol import wire
from tests.support.master_wire import hostile_hello, read_until_closed
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(
        servers=1, server_size=16 * MiB, master_args=["--master-max-message-bytes", "1M"]
    ) as c:
        yield c


def _client(endpoint: str) -> StoreClient:
    client = StoreClient(StoreClientConfig(master=endpoint, rpc_timeout=2.0))
    client.start()
    return client


def _nested(depth: int) -> bytes:
    # msgpack: 0x91 is a one-element array; the innermost element is nil.
    return b"\x91" * depth + b"\xc0"


def _raw(endpoint: str) -> ClientChannel:
    """A channel with the cluster token that sends whatever bytes a test gives it."""
    token = cluster_token(None, "", False)
    return ClientChannel.connect(endpoint, token, time.monotonic() + 5, 1 << 30)


def test_hostile_messages_cost_only_themselves(cluster: Cluster) -> None:
    raw = _raw(cluster.master_endpoint)
    deadline = time.monotonic() + 30
    client = _client(cluster.master_endpoint)
    try:
        assert client.batch_put_from(
            ["kept"], client.register(bytearray(pattern(1, 4096).tobytes())), [0], [4096]
        ).ok() == [True]
        dropped = cluster.stats().dropped
        # ~100 KB of nesting (RecursionError in the decoder), a header with a nested body, and
        # junk: each is dropped, and the master answers the next real request.
        raw.send(_nested(100_000), deadline)
        raw.send(b"\x93\x01\x07" + _nested(100_000), deadline)
        raw.send(b"\xc1" * 64, deadline)
        wait_for(lambda: cluster.stats().dropped >= dropped + 3, "hostile messages not counted")
        assert cluster.master.proc is not None
        assert cluster.master.proc.poll() is None
        assert client.get("kept") == pattern(1, 4096).tobytes()
        # Over the cap (1 MiB here): the sender is disconnected, everyone else is served.
        with contextlib.suppress(OSError):  # the master may cut it off mid-frame
            raw.send(b"\x00" * (2 * MiB), deadline)
        with pytest.raises(ConnectionError):
            raw.receive(deadline)  # the connection ends, no answer
        assert client.batch_exists(["kept", "absent"]) == [True, False]
        assert client.stats().dropped >= dropped + 3
    finally:
        raw.close()
        client.close()


def test_the_master_refuses_every_rpc_without_the_token(cluster: Cluster) -> None:
    refused = cluster.stats().refused
    client = _client(cluster.master_endpoint)
    store = cluster.stats().segments[0].name
    try:
        region = client.register(bytearray(pattern(2, 64 * 1024).tobytes()))
        keys = [f"victim-{i}" for i in range(16)]
        assert client.batch_put_from(keys, region, [0] * 16, [4096] * 16).ok() == [True] * 16
        # Without the token (plain, or a wrong proof) a Mount under the live segment's name, a
        # forced remove and a topology listing never reach the master.
        spec = m.SegmentSpec(store, "attacker:1", 1, 1 << 20, "attacker-host")
        hostile = b"".join(
            ch.LENGTH.pack(len(body)) + body
            for body in (
                msgspec.msgpack.encode(m.Envelope(m.PROTOCOL_VERSION, 1, request))
                for request in (
                    m.Mount("attacker", "mount-1", spec, [], False),
                    m.Remove(keys, True),
                    m.Stats(),
                )
            )
        )
        plain = hostile_hello(cluster.master_endpoint, flags=0)
        plain.sendall(hostile)  # as if the handshake were done
        wrong = hostile_hello(cluster.master_endpoint, flags=wire.FLAG_TOKEN)
        wrong.sendall(b"\x00" * wire.MAC_LEN + hostile)  # a made-up proof
        # Each gets the master's HELLO (and the wrong proof a refusal), then the connection
        # ends: no reply to any request.
        assert len(read_until_closed(plain, 10)) == wire.SERVER_HELLO.size
        assert read_until_closed(wrong, 10)[wire.SERVER_HELLO.size :] == b"\x01"
        wait_for(lambda: cluster.stats().refused >= refused + 2, "refusals not counted")
        view = bytearray(16 * 4096)
        result = client.batch_get_into(
            keys, client.register(view), [i * 4096 for i in range(16)], [4096] * 16
        )
        assert result.ok() == [True] * 16
        assert bytes(view) == pattern(2, 64 * 1024).tobytes()[:4096] * 16
        stats = cluster.stats()
        assert [s.name for s in stats.segments] == [store]
        assert stats.keys >= 16
        guess = RpcClient(cluster.master_endpoint, 0.5, token="not-the-cluster-token")
        with pytest.raises(MasterUnavailable, match="cluster token"):
            guess.call(m.Stats())
        guess.close()
    finally:
        client.close()


def test_a_failed_serving_loop_makes_the_master_exit_non_zero(tmp_path: Path) -> None:
    # The loop's background work fails on its third round: the process must not linger.
    script = (
        "import sys\n"
        "from kvconnect.store.master.state import MasterState\n"
        "calls = []\n"
        "def tick(self, now):\n"
        "    calls.append(now)\n"
        "    if len(calls) == 3:\n"
        "        raise RuntimeError('injected')\n"
        "MasterState.tick = tick\n"
        "from kvconnect.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-c", script, "master", "--master-listen", endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == EXIT_CRASHED, done.stderr[-2000:]
    assert "injected" in done.stderr


def _environ(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCONNECT_")}
    return {**env, "XDG_CONFIG_HOME": str(home), **extra}


def test_serve_generates_a_private_token_and_clients_on_the_host_find_it(tmp_path: Path) -> None:
    home = tmp_path / "config"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(_environ(home))
    try:
        serve = Process(
            ["serve", "--master-listen", endpoint, "--store-size", str(4 * MiB)], "serving"
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        token_file = home / "kvconnect" / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert f"generated a cluster token in {token_file}" in serve.stderr()
        token = token_file.read_text().strip()
        assert len(token) >= 32
        assert token != os.environ["KVCONNECT_TOKEN"]
        # A client of the same user on this host finds the file; one without it cannot talk.
        same = cluster_token(None, "", False, _environ(home))
        assert same == token
        transfer = TransferConfig(token=token)
        with StoreClient(StoreClientConfig(master=endpoint), transfer) as client:
            value = pattern(5, 8192).tobytes()
            assert client.put("generated", value) is m.Code.OK
            assert client.get("generated") == value
        stranger = RpcClient(endpoint, 0.5, token=None)
        with pytest.raises(MasterUnavailable):
            stranger.call(m.Stats())
        stranger.close()
    finally:
        serve.stop()


def test_insecure_must_be_explicit(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    env = _environ(tmp_path / "empty")
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        master = Process(["master", "--master-listen", endpoint, "--insecure"], "listening on")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        assert "WITHOUT authentication" in master.stderr()
        assert not (tmp_path / "empty" / "kvconnect" / "token").exists()
        plain = RpcClient(endpoint, 2.0, token=None)
        assert isinstance(plain.call(m.Stats()), m.StatsReply)
        plain.close()
    finally:
        master.stop()


def test_a_token_on_the_command_line_is_warned_about(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    master = Process(
        ["master", "--master-listen", endpoint, "--master-token", "visible-in-ps"], "listening on"
    )
    try:
        assert "prefer --token-file" in master.stderr()
        ok = RpcClient(endpoint, 2.0, token="visible-in-ps")
        assert isinstance(ok.call(m.Stats()), m.StatsReply)
        ok.close()
    finally:
        master.stop()


def test_token_sources_in_order(tmp_path: Path) -> None:
    file = tmp_path / "token"
    file.write_text("from-file\n")
    file.chmod(0o600)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    assert cluster_token("explicit", str(file), False, env) == "explicit"
    assert cluster_token(None, str(file), False, {**env, "KVCONNECT_TOKEN": "env"}) == "from-file"
    assert cluster_token(None, "", False, {**env, "KVCONNECT_TOKEN": "env"}) == "env"
    assert cluster_token(None, "", False, {**env, "KVCONNECT_TOKEN_FILE": str(file)}) == "from-file"
    assert cluster_token(None, "", True, env) is None
    generated = cluster_token(None, "", False, env)
    assert generated
    assert cluster_token(None, "", True, env) == generated
    threads = [
        threading.Thread(target=lambda: cluster_token(None, "", False, env)) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (tmp_path / "xdg" / "kvconnect" / "token").read_text().strip() == generated
