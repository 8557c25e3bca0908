"""The store as users run it: a master and store servers in their own processes on loopback,
clients in this process and in worker processes. Every read is checked byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from kvconnect._config import cluster_token
from kvconnect.errors import CircuitOpen, InvalidRequest, MasterUnavailable
from kvconnect.store import messages as m
from kvconnect.store.channel import ClientChannel
from kvconnect.store.client import BatchResult, StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster
from kvconnect.store.messages import Code
from kvconnect.store.rpc import RpcClient
from kvconnect.testing.peer import pattern
from kvconnect.transfer import TransferConfig
from tests.support.child import child_env
from tests.support.store_worker import expected, key_size
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
MiB = 1 << 20
FAST = ["--master-heartbeat-ttl", "2", "--master-lease-ttl", "3"]
FAST_SERVER = ["--store-heartbeat-interval", "0.3"]


def _client(cluster: Cluster, **overrides: object) -> StoreClient:
    settings = {"master": cluster.master_endpoint, "breaker_cooldown": 1.0, **overrides}
    client = StoreClient(StoreClientConfig.from_mapping(settings))
    client.start()
    return client


def _workers(
    cluster: Cluster, count: int, *args: str, seconds: float = 4.0
) -> list[dict[str, object]]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.store_worker",
                "--master",
                cluster.master_endpoint,
                "--seed",
                str(n),
                "--seconds",
                str(seconds),
                *args,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for n in range(count)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 60)  # a deadlock would hit this
        assert proc.returncode == 0
        results.append(json.loads(out))
    return results


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster(servers=2, server_size=64 * MiB, master_args=FAST, server_args=FAST_SERVER) as c:
        yield c


def test_values_from_one_byte_to_16_mib_across_servers_and_processes() -> None:
    with Cluster(
        servers=3, server_size=96 * MiB, master_args=FAST, server_args=FAST_SERVER
    ) as cluster:
        client = _client(cluster)
        try:
            sizes = [1, 7, 4096, 65537, MiB + 3, 16 * MiB]
            buffer = client.register(np.zeros(sum(sizes) + 64, dtype=np.uint8))
            offsets = np.cumsum([3, *sizes[:-1]]).tolist()
            keys = [f"direct-{n}" for n in sizes]
            for _key, off, size in zip(keys, offsets, sizes, strict=True):
                buffer.view[off : off + size] = pattern(size, size).data
            assert client.batch_put_from(keys, buffer, offsets, sizes).codes == (Code.OK,) * 6
            # read back in another process: every byte checked there
            check = subprocess.run(
                [sys.executable, "-c", _READ_BACK, cluster.master_endpoint, json.dumps(sizes)],
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            )
            assert check.stdout.strip() == "ok"
        finally:
            client.close()
        results = _workers(
            cluster, 4, "--ops", "put,get", "--max-size", str(16 * MiB), "--keys", "40"
        )
    for result in results:
        counts = result["counts"]
        assert isinstance(counts, dict)
        assert result["corrupt"] == 0
        assert counts.get("get:OK", 0) > 0
        assert counts.get("put:OK", 0) + counts.get("put:EXISTS", 0) > 0


_READ_BACK = """
import json, sys
import numpy as np
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.client import StoreClient
from kvconnect.store.messages import Code
from kvconnect.testing.peer import pattern
sizes = json.loads(sys.argv[2])
with StoreClient(StoreClientConfig(master=sys.argv[1])) as client:
    for size in sizes:
        value = client.get(f"direct-{size}")
        assert value == pattern(size, size).tobytes(), size
print("ok")
"""


def test_mixed_clients_under_eviction_pressure_corrupt_nothing_and_leak_no_lease() -> None:
    with Cluster(
        servers=2, server_size=8 * MiB, master_args=FAST, server_args=FAST_SERVER
    ) as cluster:
        client = _client(cluster)
        # 12 of the 16 MiB filled first: the workers' first puts already evict, however slowly
        # a loaded machine runs them
        filler = [f"fill-{n}" for n in range(12)]
        assert [client.put(key, bytes(MiB)) for key in filler] == [Code.OK] * 12
        try:
            results = _workers(
                cluster, 8, "--max-size", str(MiB), "--keys", "300", "--prefix", "p-", seconds=6.0
            )
            assert all(r["corrupt"] == 0 for r in results)
            assert client.stats().evictions > 0, "the workload must have filled the store"
            client.batch_remove(filler)
            keys = [f"p-{n}" for n in range(300)]
            # lease_ttl 3: once the workers are gone every lease lapses within 3 s (the bound
            # is the TTL itself, tripled: a leaked lease never lapses)
            wait_for(
                lambda: Code.BUSY not in client.batch_remove(keys), "a lease outlived its TTL", 9
            )
            assert client.stats().keys == 0
        finally:
            client.close()


def _keys_by_server(client: StoreClient, keys: list[str]) -> dict[str, list[str]]:
    reply = client._call(m.GetReplicas(keys))  # where each key lives, as the master says
    assert isinstance(reply, m.ReplicasReply)
    placed: dict[str, list[str]] = {}
    for key, replicas in zip(keys, reply.results, strict=True):
        placed.setdefault(replicas.locations[0].segment, []).append(key)
    return placed


def test_killed_store_server_fails_its_reads_fast_and_the_rest_serves_on() -> None:
    spread = [*FAST, "--master-allocation", "random"]  # keys on both servers, whoever writes
    with Cluster(
        servers=2, server_size=64 * MiB, master_args=spread, server_args=FAST_SERVER
    ) as cluster:
        _kill_a_server_during_reads(cluster)


def _kill_a_server_during_reads(cluster: Cluster) -> None:
    writers = [_client(cluster), _client(cluster)]
    # over TCP: a same-host reader that mapped the server's memory could still copy from it
    # after the server died (the bytes are intact), and no failure would have to show
    reader = StoreClient(
        StoreClientConfig(master=cluster.master_endpoint, io_timeout=5.0, breaker_cooldown=1.0),
        TransferConfig(transport="tcp"),
    )
    reader.start()
    try:
        keys = [f"k{n}" for n in range(64)]
        buffer = reader.register(np.zeros(64 * MiB, dtype=np.uint8))
        for n, writer in enumerate(writers):
            half = keys[n::2]
            source = writer.register(np.concatenate([pattern(i, MiB) for i in range(len(half))]))
            assert writer.batch_put_from(
                half, source, [i * MiB for i in range(len(half))], [MiB] * len(half)
            ).ok() == [True] * len(half)
        placed = _keys_by_server(reader, keys)
        assert len(placed) == 2
        victim_segment = next(iter(placed))
        victim = next(s for s in cluster.servers if victim_segment in s.banner)
        survivors = [k for k in keys if k not in placed[victim_segment]]
        box: dict[str, object] = {}

        def read() -> None:
            box["result"] = reader.batch_get_into(
                keys * 4, buffer, [(i % 64) * MiB for i in range(256)], [MiB] * 256, timeout=5.0
            )

        def reading() -> bool:
            return reader.engine.stats().transports["tcp"].bytes_read > 0

        thread = threading.Thread(target=read)
        thread.start()
        wait_for(reading, "the read never started")
        victim.kill()
        thread.join(timeout=30)
        during = box["result"]
        assert isinstance(during, BatchResult)
        # what arrived is byte-exact; the rest failed, and says so per key
        for n, code in enumerate(during.codes):
            key = keys[n % 64]
            assert code in (Code.OK, Code.FAILED, Code.TIMEOUT), (key, code)
            if code is Code.OK:
                got = buffer.view[(n % 64) * MiB : (n % 64 + 1) * MiB]
                assert got == pattern(n % 64 // 2, MiB).data, key
            else:
                assert key in placed[victim_segment], f"{key} of a live server failed: {code}"
        # until the master notices (heartbeat_ttl), it still names the dead server: every read
        # of its keys fails at once, and the failure reaches the result
        dead = placed[victim_segment]
        after = reader.batch_get_into(dead, buffer, [0] * len(dead), [MiB] * len(dead))
        assert set(after.codes) <= {Code.FAILED, Code.NOT_FOUND}, after.codes
        assert Code.FAILED in after.codes or Code.FAILED in during.codes
        # the rest of the cluster serves on, byte-exact
        result = reader.batch_get_into(
            survivors, buffer, [i * MiB for i in range(len(survivors))], [MiB] * len(survivors)
        )
        assert result.codes == (Code.OK,) * len(survivors)
        # after the heartbeat TTL the master reports the lost keys not found, at once (asked
        # through a fresh client: the reader's negative cache already hides the failed keys)
        observer = _client(cluster)
        writers.append(observer)
        wait_for(
            lambda: not any(observer.batch_exists(placed[victim_segment])),
            "lost keys still listed",
            10,
        )
        start = time.monotonic()
        lost = reader.batch_get_into(
            placed[victim_segment],
            buffer,
            [0] * len(placed[victim_segment]),
            [MiB] * len(placed[victim_segment]),
        )
        assert set(lost.codes) == {Code.NOT_FOUND}
        assert time.monotonic() - start < 1.0
        assert writers[0].put("after-the-loss", b"x" * 1000) is Code.OK
        assert reader.get("after-the-loss") == b"x" * 1000
    finally:
        for client in (*writers, reader):
            client.close()


def test_killed_master_gives_clear_errors_and_clients_recover_after_restart(
    cluster: Cluster,
) -> None:
    client = _client(cluster, rpc_timeout=0.5)
    try:
        assert client.put("before", b"v" * 100) is Code.OK
        # the master's journal tells the store server it holds "before" (next heartbeat)
        wait_for(lambda: _backlog(cluster) == 0, "the store server did not learn of the object")
        cluster.master.kill()
        start = time.monotonic()
        with pytest.raises(MasterUnavailable):
            client.exists("before")
        assert time.monotonic() - start < 1.5
        buffer = client.register(bytearray(100))
        for _ in range(2):
            assert client.batch_get_into(["before"], buffer, [0], [100]).codes == (
                Code.UNAVAILABLE,
            )
        start = time.monotonic()
        with pytest.raises(CircuitOpen):  # three failures in a row: fail fast now
            client.exists("before")
        assert time.monotonic() - start < 0.1
        cluster.restart_master()
        # store servers mount again by themselves (their heartbeat learns the master forgot them)
        wait_for(lambda: _mounted(cluster) == 2, "servers did not mount again", 10)
        wait_for(lambda: _answers(client), "the breaker never let a probe through", 10)
        # the restarted master indexed what the servers reported: the object survived, and the
        # servers' memory now has new region ids (fenced), which clients pick up by themselves
        assert client.exists("before") is True
        assert client.get("before") == b"v" * 100
        assert client.put("after", b"w" * 100) is Code.OK
        assert client.get("after") == b"w" * 100
    finally:
        client.close()


def _answers(client: StoreClient) -> bool:
    """Whether the master answers the client (its breaker let the call through)."""
    try:
        client.stats()
    except (CircuitOpen, MasterUnavailable):
        return False
    return True


def _backlog(cluster: Cluster) -> int:
    """Journal changes the store servers have not acknowledged yet."""
    rpc = RpcClient(cluster.master_endpoint, 0.5, token=cluster_token(None, "", False))
    try:
        reply = rpc.call(m.Stats())
        assert isinstance(reply, m.StatsReply)
        return sum(segment.backlog for segment in reply.segments)
    finally:
        rpc.close()


def _mounted(cluster: Cluster) -> int:
    rpc = RpcClient(cluster.master_endpoint, 0.5, token=cluster_token(None, "", False))
    try:
        reply = rpc.call(m.Stats())
        return len(reply.segments) if isinstance(reply, m.StatsReply) else -1
    except MasterUnavailable:
        return -1
    finally:
        rpc.close()


def test_bad_input_gets_clear_errors_and_loses_nothing(cluster: Cluster) -> None:
    client = _client(cluster)
    try:
        buffer = client.register(np.zeros(MiB, dtype=np.uint8))
        buffer.view[:] = pattern(3, MiB).data
        codes = client.batch_put_from(
            ["", "x" * 2000, "zero", "good"], buffer, [0, 0, 0, 0], [10, 10, 0, 10]
        ).codes
        assert codes == (Code.INVALID, Code.INVALID, Code.INVALID, Code.OK)
        assert client.batch_get_into(["good"], buffer, [100], [5]).codes == (Code.TOO_SMALL,)
        assert client.batch_get_into(["missing"], buffer, [0], [5]).codes == (Code.NOT_FOUND,)
        with pytest.raises(InvalidRequest, match="sizes"):
            client.batch_put_from(["a", "b"], buffer, [0, 1], [1])
        stranger = StoreClient(StoreClientConfig(master=cluster.master_endpoint))
        foreign = stranger.engine.register(bytearray(100))  # not registered with `client`
        with pytest.raises(InvalidRequest, match="not registered"):
            client.batch_put_from(["foreign"], foreign, [0], [100])
        stranger.close()
        assert client.stats().pending == 0, "a refused batch left an allocation behind"
        assert client.get("good") == pattern(3, MiB)[:10].tobytes()
        rpc = RpcClient(cluster.master_endpoint, 2.0, token=cluster_token(None, "", False))
        assert rpc.call(m.Unmount("nobody", ["no-such-mount"])) == m.CodesReply(
            [Code.UNKNOWN_SEGMENT]
        )
        rpc.close()
    finally:
        client.close()


def test_malformed_frames_and_floods_leave_the_master_serving(cluster: Cluster) -> None:
    token = cluster_token(None, "", False)
    deadline = time.monotonic() + 60
    raw = ClientChannel.connect(cluster.master_endpoint, token, deadline, 1 << 30)
    try:
        for junk in (b"", b"\x00" * 10, b"garbage" * 100, msgspec.msgpack.encode([1, 2])):
            raw.send(junk, deadline)
        newer = msgspec.msgpack.encode([m.PROTOCOL_VERSION + 1, 7, {"type": "exists", "keys": []}])
        raw.send(newer, deadline)
        # Junk without a request id gets no answer; [1, 2] reads as request 2 (malformed), and
        # the newer version as request 7: each gets its error, in order.
        replies = [msgspec.msgpack.decode(raw.receive(deadline), type=m.ReplyEnvelope)]
        if replies[0].request_id != 7:
            replies.append(msgspec.msgpack.decode(raw.receive(deadline), type=m.ReplyEnvelope))
        assert isinstance(replies[-1].body, m.Error)
        assert (replies[-1].request_id, replies[-1].body.code) == (7, Code.VERSION)
        for _ in range(20000):  # a flood of garbage
            raw.send(b"\xc1" * 64, deadline)
        client = _client(cluster)
        errors: list[BaseException] = []

        def hammer() -> None:
            try:
                for _ in range(300):
                    client.batch_exists(["k"] * 16)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=hammer) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == []
        assert client.put("still", b"up") is Code.OK
        assert client.get("still") == b"up"
        client.close()
    finally:
        raw.close()


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_client_without_memory_over_tcp_and_same_host(cluster: Cluster, transport: str) -> None:
    client = StoreClient(
        StoreClientConfig(master=cluster.master_endpoint), TransferConfig(transport=transport)
    )  # type: ignore[arg-type]
    client.start()
    try:
        keys = [f"{transport}-{n}" for n in range(8)]
        source = client.register(np.concatenate([expected(k, MiB) for k in keys]))
        offsets = np.cumsum([0] + [key_size(k, MiB) for k in keys[:-1]]).tolist()
        sizes = [key_size(k, MiB) for k in keys]
        assert client.batch_put_from(keys, source, offsets, sizes).ok() == [True] * 8
        target = client.register(np.zeros(source.length, dtype=np.uint8))
        result = client.batch_get_into(keys, target, offsets, sizes)
        assert result.codes == (Code.OK,) * 8
        assert target.view == source.view
        used = {k: v.bytes_read for k, v in client.engine.stats().transports.items()}
        assert used["shm" if transport == "auto" else "tcp"] == sum(sizes)
    finally:
        client.close()


def test_status_command_prints_the_cluster(cluster: Cluster) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvconnect.cli", "status", "--master", cluster.master_endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "0 keys" in out
    assert out.count(" 67108864 ") == 2  # two segments of 64 MiB listed


def _segment(cluster: Cluster) -> m.SegmentStats:
    (segment,) = cluster.stats().segments
    return segment


def test_a_store_crossing_the_watermark_is_evicted_to_about_90_percent() -> None:
    # The reported case: 64 MiB crossing 95 % with one 1 MiB put, the writer going on
    with Cluster(servers=1, server_size=64 * MiB, master_args=FAST) as cluster:
        client = _client(cluster)
        try:
            value = b"e" * MiB
            lowest = 64 * MiB
            codes = []
            for n in range(100):
                codes.append(client.put(f"page-{n}", value))
                if n >= 61:  # past 95 %: eviction runs between requests
                    lowest = min(lowest, _segment(cluster).used)
            assert cluster.stats().evictions > 0
            assert set(codes) <= {Code.OK, Code.BUSY}, "space coming back started more rounds"
            wait_for(lambda: _segment(cluster).in_transit == 0, "evicted space never came back")
            lowest = min(lowest, _segment(cluster).used)
            assert lowest >= 0.90 * 64 * MiB - MiB, f"evicted to {lowest / (64 * MiB):.0%}"
        finally:
            client.close()


def test_four_clients_churning_under_leases_evict_nothing_and_are_never_refused() -> None:
    # Each client puts a page, reads it (a read lease of 3 s), removes it by force: the
    # space waits for the lease, but it is no stored data.
    with Cluster(
        servers=1, server_size=16 * MiB, master_args=FAST, server_args=FAST_SERVER
    ) as cluster:
        keeper = _client(cluster)
        clients = [_client(cluster) for _ in range(4)]
        counts: list[dict[Code, int]] = [{} for _ in clients]
        wrong: list[str] = []  # what a churning thread saw go wrong
        try:
            keep = {f"keep-{n}": pattern(n, 256 << 10).tobytes() for n in range(8)}
            for key, value in keep.items():
                assert keeper.put(key, value) is Code.OK

            def churn(n: int) -> None:
                client = clients[n]
                for i in range(150):
                    key = f"churn-{n}-{i}"
                    code = client.put(key, b"c" * (256 << 10))
                    counts[n][code] = counts[n].get(code, 0) + 1
                    if code is not Code.OK:
                        continue
                    if client.get(key) != b"c" * (256 << 10):
                        wrong.append(f"{key} read back wrong")
                    if client.remove(key, force=True) is not Code.OK:
                        wrong.append(f"{key} not removed")

            threads = [threading.Thread(target=churn, args=(n,)) for n in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            assert wrong == []
            totals = {code: sum(c.get(code, 0) for c in counts) for code in Code}
            assert totals[Code.NO_SPACE] == 0, totals
            assert {c for c, n in totals.items() if n} <= {Code.OK, Code.BUSY}, totals
            stats = cluster.stats()
            assert stats.evictions == 0, "kept keys were evicted for space in transit"
            assert stats.segments[0].used == 8 * (256 << 10)
            assert all(keeper.get(key) == value for key, value in keep.items())
            # the leases end, the space returns: the store takes what it has room for
            wait_for(lambda: _segment(cluster).in_transit == 0, "space never came back")
            for n in range(56):
                assert keeper.put(f"after-{n}", b"a" * (256 << 10)) is Code.OK, n
        finally:
            for client in (keeper, *clients):
                client.close()


def test_a_key_removed_under_a_lease_stays_removed_after_a_master_restart() -> None:
    lease = ["--master-lease-ttl", "60"]  # far longer than the test
    with Cluster(servers=1, master_args=lease, server_args=FAST_SERVER) as cluster:
        client = _client(cluster, rpc_timeout=0.5)
        try:
            assert client.put("removed", b"r" * 1000) is Code.OK
            assert client.put("kept", b"k" * 1000) is Code.OK
            assert client.get("removed") == b"r" * 1000  # leased for 60 s
            assert client.remove("removed", force=True) is Code.OK
            # the store server learns of the removal with its next heartbeats
            wait_for(lambda: _backlog(cluster) == 0, "the removal never reached the server")
            cluster.master.kill()
            cluster.restart_master()
            wait_for(lambda: _mounted(cluster) == 1, "the server did not mount again", 10)
            observer = _client(cluster)
            try:
                assert observer.batch_exists(["removed", "kept"]) == [False, True]
                assert observer.get("removed") is None
                assert observer.get("kept") == b"k" * 1000
            finally:
                observer.close()
        finally:
            client.close()
