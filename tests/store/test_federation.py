"""Federation: two complete clusters on loopback (own masters, store servers and tokens); a
client of the home cluster reads what home lacks from the peer, byte for byte, and a peer
that is stopped, killed or refuses our token costs one bounded attempt, never home's reads."""

from __future__ import annotations

import collections
import gc
import json
import logging
import secrets
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import cast

import msgspec
import numpy as np
import pytest

from kvconnect.bench.etcd import EtcdServer, etcd_available
from kvconnect.errors import ConfigError, RegistrationError
from kvconnect.store.batching import Span
from kvconnect.store.client import StoreClient
from kvconnect.store.config import PeerConfig, StoreClientConfig
from kvconnect.store.federation import Federation
from kvconnect.store.launch import Cluster, Process, free_port
from kvconnect.store.messages import Code, PeerSummary
from kvconnect.store.resilience import BreakerState, CircuitBreaker
from kvconnect.testing.peer import pattern
from kvconnect.transfer import TransferConfig
from tests.support.ha import leader_of, leader_stats
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
MiB = 1 << 20
FAST_SERVER = ["--store-heartbeat-interval", "0.3"]


def _token(path: Path) -> str:
    path.write_text(secrets.token_hex(16) + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    base = tmp_path_factory.mktemp("tokens")
    return _token(base / "home"), _token(base / "peer")


@pytest.fixture
def clusters(tokens: tuple[str, str]) -> Iterator[tuple[Cluster, Cluster]]:
    home_token, peer_token = tokens
    with (
        Cluster(1, 32 * MiB, server_args=FAST_SERVER, token_file=home_token) as home,
        Cluster(1, 32 * MiB, server_args=FAST_SERVER, token_file=peer_token) as peer,
    ):
        yield home, peer


def _client(
    cluster: Cluster, *peers: PeerConfig, transport: str = "auto", **settings: object
) -> StoreClient:
    """A client of ``cluster``; its peers' engines take its ``transport``."""
    config = StoreClientConfig(master=cluster.master_endpoint, peers=peers).replace(**settings)
    transfer = TransferConfig.from_mapping(
        {"token_file": cluster.token_file, "transport": transport}
    )
    client = StoreClient(config, transfer)
    client.start()
    return client


def _peer(cluster: Cluster, **overrides: object) -> PeerConfig:
    settings = {"name": "east", "master": cluster.master_endpoint, "token_file": cluster.token_file}
    return PeerConfig.from_mapping({**settings, **overrides})


def _values(prefix: str, count: int, seed: int) -> dict[str, bytes]:
    return {f"{prefix}{i}": pattern(seed + i, 3000 + 17 * i).tobytes() for i in range(count)}


def _fill(cluster: Cluster, values: dict[str, bytes]) -> None:
    with _client(cluster) as writer:
        for key, value in values.items():
            assert writer.put(key, value) is Code.OK


def _status(client: StoreClient) -> dict[str, object]:
    (peer,) = client.peers()
    return {"breaker": peer.breaker} | msgspec.structs.asdict(peer.counts)


def test_keys_home_lacks_are_read_from_the_peer_byte_for_byte(
    clusters: tuple[Cluster, Cluster],
) -> None:
    home, peer = clusters
    at_home, at_peer = _values("h", 4, 1), _values("p", 6, 100)
    _fill(home, at_home)
    _fill(peer, at_peer | {"h0": b"the peer's older value"})  # home's value wins
    with _client(home, _peer(peer)) as client:
        keys = [*at_home, *at_peer, "nowhere"]
        assert client.batch_exists(keys) == [True] * 10 + [False]
        buffer = bytearray(len(keys) * 4096)
        region = client.register(buffer)
        result = client.batch_get_into(keys, region, [i * 4096 for i in range(11)], [4096] * 11)
        assert result.codes == (Code.OK,) * 10 + (Code.NOT_FOUND,)
        wanted = [*at_home.values(), *at_peer.values()]
        for i, value in enumerate(wanted):
            assert bytes(buffer[i * 4096 : i * 4096 + len(value)]) == value
        assert result.sizes[:10] == tuple(len(v) for v in wanted)
        assert client.get("p3") == at_peer["p3"]
        # a scattered read of a peer object: its bytes 1000..2999 into two spans
        scattered = bytearray(2000)
        spans = client.register(scattered)
        got = client.batch_get_scattered(
            ["p2"], [[Span(spans, 0, 500), Span(spans, 500, 1500)]], object_offsets=[1000]
        )
        assert got.codes == (Code.OK,)
        assert bytes(scattered) == at_peer["p2"][1000:3000]
        status = _status(client)
        assert status["hits"] == 6 + 1 + 1
        assert status["failures"] == 0
    with _client(home) as isolated:  # without the peer, home has only its own keys
        assert isolated.batch_exists(keys) == [True] * 4 + [False] * 7


def test_a_buffer_unregistered_at_home_is_released_by_the_peer_engine_too(
    clusters: tuple[Cluster, Cluster],
) -> None:
    home, peer = clusters
    at_peer = _values("p", 2, 110)
    _fill(peer, at_peer)
    with _client(home, _peer(peer)) as client:
        memory = np.zeros(8192, dtype=np.uint8)
        released = weakref.ref(memory)
        region = client.register(memory)
        assert client.batch_get_into(["p0"], region, [0], [8192]).codes == (Code.OK,)
        assert memory[: len(at_peer["p0"])].tobytes() == at_peer["p0"]
        client.engine.unregister(region)
        del memory, region
        assert released() is not None  # the peer engine's alias still holds it
        assert client.get("p1") == at_peer["p1"]  # any later read lets the alias go
        other = client.register(bytearray(8192))
        assert client.batch_get_into(["p1"], other, [0], [8192]).ok() == [True]
        gc.collect()
        assert released() is None


def test_a_key_the_peer_lacks_is_not_asked_again_within_the_negative_ttl(
    clusters: tuple[Cluster, Cluster],
) -> None:
    home, peer = clusters
    with _client(home, _peer(peer, negative_ttl=30.0)) as client:
        assert client.batch_exists(["absent0", "absent1"]) == [False, False]
        assert _status(client)["asked"] == 2
        assert client.batch_exists(["absent0", "absent1", "absent2"]) == [False] * 3
        assert _status(client)["asked"] == 3  # only absent2 went to the peer
    with _client(home, _peer(peer, negative_ttl=0)) as client:
        client.batch_exists(["absent0"])
        client.batch_exists(["absent0"])
        assert _status(client)["asked"] == 2


def test_a_peer_hit_is_copied_home_in_the_background(clusters: tuple[Cluster, Cluster]) -> None:
    home, peer = clusters
    values = _values("c", 3, 7)
    _fill(peer, values)
    with _client(home, _peer(peer, copy_home=True)) as client, _client(home) as plain:
        assert plain.batch_exists(list(values)) == [False] * 3
        for key, value in values.items():
            assert client.get(key) == value
        # counted once home's master took it: every copy is readable then
        wait_for(lambda: _status(client)["copied"] == 3, "peer hits copied home")
        for key, value in values.items():
            assert plain.get(key) == value


class _ScriptedPeer:
    """A peer cluster's client that has every key (its value: the key's bytes); key "d" can
    be read once, then its buffer cannot be registered."""

    breaker = CircuitBreaker(1, 1.0)

    def __init__(self) -> None:
        self.reads: collections.Counter[str] = collections.Counter()

    def start(self) -> None: ...
    def connect(self, timeout: float) -> None: ...
    def close(self) -> None: ...

    def get(self, key: str, *, timeout: float | None = None) -> bytearray:
        self.reads[key] += 1
        if key == "d" and self.reads[key] > 1:
            raise RegistrationError("no room to register the buffer")
        return bytearray(key.encode())


def test_a_failed_copy_is_tried_once_more_after_the_copies_behind_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A copy home whose write failed is tried again after those queued behind it: counted
    when the retry finds the key stored (EXISTS: the first write was stored but not confirmed
    in time), dropped with one debug line when it fails again — a copy that raises too, and
    the copier goes on. (Logic only: a scripted peer and home; the copies' data path is the
    real one in the tests above.)"""
    answers = {"a": [Code.TIMEOUT, Code.EXISTS], "b": [Code.OK], "c": [Code.BUSY, Code.BUSY]}
    writes: list[tuple[str, bytes]] = []

    def put_home(key: str, value: bytearray) -> Code:
        writes.append((key, bytes(value)))
        return answers[key].pop(0)

    peer = PeerConfig(name="east", master="tcp://127.0.0.1:1", insecure=True, copy_home=True)
    federation = Federation(
        StoreClientConfig(master="tcp://127.0.0.1:2", peers=(peer,), peer_report_interval=0),
        TransferConfig(insecure=True),
        make_client=lambda *_: cast("StoreClient", _ScriptedPeer()),
        home_owns=lambda _: True,
        put_home=put_home,
        get_home=lambda _: None,
        report_home=lambda _: None,
        client_id="test",
        clock=time.monotonic,
    )
    for key in [*answers, "d"]:  # every hit queued before the copier starts: a fixed order
        assert federation.get(key, time.monotonic() + 5) == key.encode()
    with caplog.at_level(logging.DEBUG, logger="kvconnect"), closing(federation):
        federation.start()
        wait_for(lambda: "copy of d" in caplog.text, "the second failure of d never logged")
    assert [key for key, _ in writes] == ["a", "b", "c", "a", "c"]
    assert all(value == key.encode() for key, value in writes)
    (status,) = federation.status()
    assert (status.counts.hits, status.counts.copied) == (4, 2)
    dropped = [r.getMessage() for r in caplog.records if "copy of" in r.getMessage()]
    assert len(dropped) == 2
    assert "copy of c" in dropped[0]
    assert dropped[0].endswith("failed: BUSY")
    assert dropped[1].endswith("failed: RegistrationError: no room to register the buffer")


def test_a_peer_that_refuses_our_token_is_skipped_and_home_still_serves(
    clusters: tuple[Cluster, Cluster], tokens: tuple[str, str]
) -> None:
    home, peer = clusters
    at_home = _values("h", 3, 50)
    _fill(home, at_home)
    _fill(peer, _values("p", 3, 60))
    wrong = _peer(peer, token_file=tokens[0])  # home's token, not the peer's
    with _client(home, wrong) as client:
        # refused as the client started (its first connection): down before any call
        wait_for(lambda: _status(client)["failures"] == 1, "the peer's refusal at start")
        assert _status(client)["breaker"] is not BreakerState.CLOSED
        assert client.batch_exists([*at_home, "p0"]) == [True, True, True, False]
        assert client.batch_exists(["p1"]) == [False]
        status = _status(client)
        assert (status["asked"], status["failures"], status["skipped"]) == (0, 1, 2)
        for key, value in at_home.items():
            assert client.get(key) == value


def test_each_peer_is_connected_before_the_first_call(clusters: tuple[Cluster, Cluster]) -> None:
    """The peer's short rpc_timeout covers a caller's request, not a handshake too: the
    client connects as it starts, and callers on threads of their own take that connection."""
    home, peer = clusters
    values = _values("w", 2, 40)
    _fill(peer, values)
    before = peer.stats().connections  # its store server's, and this stats call's own
    with _client(home, _peer(peer, probe_interval=60.0)) as client:
        wait_for(lambda: peer.stats().connections == before + 1, "the connection at start")
        found: list[list[bool]] = []
        for key in [*values, "nowhere"]:  # each call on a thread that ends, as vLLM's lanes do
            caller = threading.Thread(target=lambda k=key: found.append(client.batch_exists([k])))
            caller.start()
            caller.join(10)
        assert found == [[True], [True], [False]]
        assert peer.stats().connections == before + 1
        assert (_status(client)["asked"], _status(client)["failures"]) == (3, 0)
    wait_for(lambda: peer.stats().connections == before, "the client's connection closed")


@pytest.mark.parametrize("fault", ["stopped", "killed"])
def test_a_dead_or_stopped_peer_costs_one_bounded_attempt_then_comes_back(
    clusters: tuple[Cluster, Cluster], fault: str
) -> None:
    home, peer = clusters
    at_home, at_peer = _values("h", 4, 10), _values("p", 4, 20)
    _fill(home, at_home)
    _fill(peer, at_peer)
    config = _peer(peer, rpc_timeout=0.3, probe_interval=0.3, negative_ttl=0)
    with _client(home, config) as client:
        assert client.get("p0") == at_peer["p0"]
        if fault == "stopped":
            peer.master.signal(signal.SIGSTOP)
        else:
            peer.master.kill()
        buffer = bytearray(8 * 4096)
        region = client.register(buffer)
        keys = [*at_home, *at_peer]
        first = client.batch_get_into(keys, region, [i * 4096 for i in range(8)], [4096] * 8)
        assert first.codes[:4] == (Code.OK,) * 4  # home's keys unaffected
        assert all(code is not Code.OK for code in first.codes[4:])
        assert _status(client)["breaker"] is not BreakerState.CLOSED
        for i, value in enumerate(at_home.values()):
            assert bytes(buffer[i * 4096 : i * 4096 + len(value)]) == value
        asked = _status(client)["asked"]
        again = client.batch_get_into(keys, region, [i * 4096 for i in range(8)], [4096] * 8)
        assert again.codes[:4] == (Code.OK,) * 4
        status = _status(client)
        assert status["asked"] == asked
        assert status["skipped"] == 4
        assert status["failures"] == 1
        if fault == "stopped":
            peer.master.signal(signal.SIGCONT)
        else:
            peer.restart_master()  # an empty master: the server mounts again, objects gone
            wait_for(lambda: bool(peer.stats().segments), "the peer's server mounts again")
            _fill(peer, at_peer)
        wait_for(lambda: _status(client)["breaker"] is BreakerState.CLOSED, "probe finds the peer")
        for key, value in at_peer.items():
            assert client.get(key) == value


def test_a_stopped_peer_store_server_times_out_within_the_peer_share(
    clusters: tuple[Cluster, Cluster],
) -> None:
    home, peer = clusters
    at_peer = _values("p", 2, 30)
    _fill(peer, at_peer)
    # over TCP: through shared memory a stopped server's memory is still read (one-sided)
    config = _peer(peer, share=0.25, probe_interval=60.0)  # no probe closes it meanwhile
    with _client(home, config, transport="tcp") as client:
        assert client.get("p0") == at_peer["p0"]
        peer.servers[0].signal(signal.SIGSTOP)
        try:
            buffer = bytearray(4096)
            region = client.register(buffer)
            result = client.batch_get_into(["p1"], region, [0], [4096], timeout=2.0)
            assert result.codes[0] in (Code.TIMEOUT, Code.UNSETTLED)
            assert _status(client)["breaker"] is not BreakerState.CLOSED
            assert client.batch_exists(["p0"]) == [False]  # skipped until a probe
        finally:
            peer.servers[0].signal(signal.SIGCONT)


def test_peers_are_configured_through_the_client_section() -> None:
    env = {
        "KVCONNECT_CLIENT_PEERS": '[{"name": "east", "master": "tcp://10.0.0.2:50051", '
        '"token_file": "/etc/kvconnect/east.token", "share": 0.3}]'
    }
    config = StoreClientConfig.from_env(env)
    (peer,) = config.peers
    assert (peer.name, peer.master, peer.token_file, peer.share) == (
        "east",
        "tcp://10.0.0.2:50051",
        "/etc/kvconnect/east.token",
        0.3,
    )
    with pytest.raises(ConfigError, match="unique"):
        StoreClientConfig.from_mapping({"peers": [{"name": "a", "master": "tcp://x:1"}] * 2})
    with pytest.raises(ConfigError, match="home cluster"):
        StoreClientConfig.from_mapping(
            {"peers": [{"name": "a", "master": "tcp://127.0.0.1:50051"}]}
        )
    with pytest.raises(ConfigError, match="valid: "):
        StoreClientConfig.from_mapping(
            {"peers": [{"name": "a", "master": "tcp://x:1", "sahre": 1}]}
        )


def test_status_shows_each_peer_reachable_or_not(
    clusters: tuple[Cluster, Cluster], tmp_path: Path
) -> None:
    home, peer = clusters
    _fill(peer, _values("p", 5, 90))
    dead = f"tcp://127.0.0.1:{free_port()}"
    peers = [_peer(peer, name="east"), _peer(peer, name="west", master=dead)]
    listing = [
        {"name": p.name, "master": p.master, "token_file": p.token_file, "rpc_timeout": 0.2}
        for p in peers
    ]
    config = tmp_path / "peers.json"
    config.write_text(json.dumps({"peers": listing}))
    command = [sys.executable, "-m", "kvconnect.cli", "status", "--master", home.master_endpoint]
    command += ["--token-file", home.token_file, "--peers", str(config)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["east"][2] == "reachable"
    assert lines["east"][4] == "5"  # its keys
    assert lines["west"][2] == "unreachable"
    assert "0 keys" in out  # home's own line


def test_status_shows_the_peers_clients_report_breakers_and_hit_shares(
    clusters: tuple[Cluster, Cluster],
) -> None:
    """Two clients of home: one reads from a healthy peer, one has a dead peer (its breaker
    open). The home master sums their reports; ``kvconnect status`` shows them."""
    home, peer = clusters
    at_home, at_peer = _values("h", 3, 200), _values("p", 5, 300)
    _fill(home, at_home)
    _fill(peer, at_peer)
    dead = _peer(peer, name="west", master=f"tcp://127.0.0.1:{free_port()}", rpc_timeout=0.2)
    reporting = {"peer_report_interval": 0.2}
    with (
        _client(home, _peer(peer), **reporting) as reader,
        _client(home, dead, **reporting) as cut_off,
    ):
        for key, value in {**at_home, **at_peer}.items():
            assert reader.get(key) == value
        # its connection at start failed (its breaker open): the call skips the dead peer
        wait_for(lambda: _status(cut_off)["failures"] == 1, "the dead peer's failure at start")
        assert cut_off.batch_exists(["p0"]) == [False]

        def reported() -> dict[str, PeerSummary]:
            return {p.peer: p for p in home.stats().peers}

        def both_in() -> bool:
            seen = reported()
            done = seen.keys() == {"east", "west"}
            return done and seen["east"].counts.hits == 5 and seen["west"].down == 1

        wait_for(both_in, "both clients' reports at the home master")
        east, west = reported()["east"], reported()["west"]
        assert (east.clients, east.down, east.counts.asked, east.counts.hits) == (1, 0, 5, 5)
        assert east.reads == 3 + 5  # three keys read from home, five from the peer
        assert east.counts.bytes_read == sum(map(len, at_peer.values()))
        assert (west.clients, west.down, west.counts.failures, west.counts.hits) == (1, 1, 1, 0)
        assert (west.counts.asked, west.counts.skipped) == (0, 1)
        command = [sys.executable, "-m", "kvconnect.cli", "status"]
        command += ["--master", home.master_endpoint, "--token-file", home.token_file]
        out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
        rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line}
        # peer, master, clients, up, down, hit share, hits, asked, failures, skipped, copied
        assert rows["east"][2:7] == ["1", "1", "0", "62.5%", "5"]
        assert rows["west"][2:5] == ["1", "0", "1"]


def test_writes_are_copied_to_a_peer_with_copy_writes(clusters: tuple[Cluster, Cluster]) -> None:
    """A client writes home; its copy_writes peer gets each key in the background, byte for
    byte. Keys it copies home from that peer are not copied back."""
    home, peer = clusters
    at_peer = _values("p", 2, 400)
    _fill(peer, at_peer)
    written = _values("w", 4, 500)
    config = _peer(peer, copy_writes=True, copy_home=True)
    with _client(home, config) as client, _client(peer) as there:
        keys = list(written)
        assert client.put(keys[0], written[keys[0]]) is Code.OK
        batch = bytearray(b"".join(written[k] for k in keys[1:]))
        region = client.register(batch)
        sizes = [len(written[k]) for k in keys[1:]]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        assert client.batch_put_from(keys[1:], region, offsets, sizes).ok() == [True] * 3
        for key, value in at_peer.items():
            assert client.get(key) == value
        wait_for(lambda: _status(client)["copied"] == 4 + 2, "copies both ways")
        for key, value in written.items():
            assert there.get(key) == value
        with _client(home) as plain:
            for key, value in at_peer.items():
                assert plain.get(key) == value
        # One copier, first in first out: a copy back of the two copied home would have been
        # queued (and counted) before this write's.
        assert client.put("w-last", b"last") is Code.OK

        def last_copied() -> bool:
            return _status(client)["copied"] > 6 and there.get("w-last") is not None

        wait_for(last_copied, "the last write copied")
        assert _status(client)["copied"] == 7  # the two copied home were not copied back


@pytest.mark.skipif(not etcd_available(), reason="etcd is not installed")
def test_a_peer_master_failover_is_followed_like_homes(tokens: tuple[str, str]) -> None:
    """The peer cluster runs two masters under etcd; its leader is SIGKILLed: the client
    follows the peer to its new leader and reads the peer's keys again, home's throughout."""
    with EtcdServer() as etcd, Cluster(1, 16 * MiB, token_file=tokens[0]) as home:
        url = etcd.url
        masters = [
            Process(
                ["master", "--ha", url, "--master-listen", f"tcp://127.0.0.1:{free_port()}"],
                "listening on",
            )
            for _ in range(2)
        ]
        server = Process(
            ["store", "--store-master", url, "--store-size", "16M", *FAST_SERVER],
            "kvconnect store server",
        )
        try:
            wait_for(lambda: _mounted(url) == 1, "the peer's server mounts")
            at_home, at_peer = _values("h", 3, 70), _values("p", 3, 80)
            _fill(home, at_home)
            with StoreClient(StoreClientConfig(master=url)) as writer:
                for key, value in at_peer.items():
                    assert writer.put(key, value) is Code.OK
            peer = PeerConfig(name="ha", master=url, probe_interval=0.3)
            with _client(home, peer) as client:
                assert client.get("p0") == at_peer["p0"]
                # the peer's server knows its objects (what survives a failover: docs/store.md)
                wait_for(lambda: _backlog(url) == 0, "the peer's journal is acknowledged")
                leader = leader_of(url)
                next(m for m in masters if leader is not None and leader in m.args).kill()
                for key, value in at_home.items():
                    assert client.get(key) == value
                wait_for(lambda: client.get("p1") == at_peer["p1"], "peer read after failover", 30)
                for key, value in at_peer.items():
                    assert client.get(key) == value
        finally:
            server.stop()
            for master in masters:
                master.stop()


def _mounted(url: str) -> int:
    reply = leader_stats(url)
    return 0 if reply is None else len(reply.segments)


def _backlog(url: str) -> int:
    reply = leader_stats(url)
    return -1 if reply is None else sum(s.backlog for s in reply.segments)
