"""The store client's contract against a real master and store servers: bad keys and oversized
batches get per-key codes, invalid arguments raise, reads fall back to a live replica, and
memory a transport thread still holds is never handed back."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvconnect.errors import InvalidRequest, StoreError
from kvconnect.store import messages as m
from kvconnect.store.batching import MAX_SPANS, BatchResult, Span
from kvconnect.store.client import MASTER_RUN, StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster, Process
from kvconnect.store.messages import Code
from kvconnect.store.resilience import BreakerState
from kvconnect.testing.peer import pattern
from kvconnect.transfer import TransferConfig
from kvconnect.transfer.batch import Slice
from kvconnect.transfer.datapath.copying import Copier, CopyWorkers
from kvconnect.transfer.memory import MemoryRegion
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
KiB, MiB = 1 << 10, 1 << 20
FAST_SERVER = ["--store-heartbeat-interval", "0.3"]

# Keys no store can hold: a lone surrogate (cannot be encoded), empty, too long (in bytes),
# NUL, not a string at all.
BAD_KEYS: list[Any] = ["\ud800", "", "é" * 600, "x" * 1025, "a\0b", 17, None, b"bytes"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(servers=1, server_size=32 * MiB, server_args=FAST_SERVER) as c:
        yield c


@pytest.fixture
def client(cluster: Cluster) -> Iterator[StoreClient]:
    with StoreClient(StoreClientConfig(master=cluster.master_endpoint)) as c:
        yield c


def _filled(client: StoreClient, seed: int, size: int) -> MemoryRegion:
    return client.register(pattern(seed, size).copy())


# ------------------------------------------------------------------------------ A3: bad keys


def test_bad_keys_are_invalid_per_key_and_the_rest_of_the_batch_goes_through(
    client: StoreClient,
) -> None:
    good = ["good-a", "good-b", "ключ-✓", np.str_("numpy-str")]
    keys = [good[0], *BAD_KEYS[:4], good[1], *BAD_KEYS[4:], good[2], good[3]]
    count = len(keys)
    source = _filled(client, 1, count * KiB)
    offsets = [n * KiB for n in range(count)]
    put = client.batch_put_from(keys, source, offsets, [KiB] * count)
    expected = tuple(Code.OK if key in good else Code.INVALID for key in keys)
    assert put.codes == expected
    assert put.sizes == tuple(KiB if key in good else 0 for key in keys)

    target = client.register(np.zeros(count * KiB, dtype=np.uint8))
    got = client.batch_get_into(keys, target, offsets, [KiB] * count)
    assert got.codes == expected
    assert got.sizes == put.sizes
    for n, key in enumerate(keys):
        chunk = target.view[n * KiB : (n + 1) * KiB]
        want = source.view[n * KiB : (n + 1) * KiB] if key in good else bytes(KiB)
        assert bytes(chunk) == bytes(want), key

    assert client.batch_exists(keys) == [key in good for key in keys]
    parts = client.batch_put_part_from(
        ["part-ok", "\udfff", ""],
        source,
        [0, 0, 0],
        [KiB] * 3,
        part=0,
        parts=1,
        object_sizes=[KiB] * 3,
        object_offsets=[0] * 3,
    )
    assert parts.codes == (Code.OK, Code.INVALID, Code.INVALID)
    assert client.get("part-ok") == bytes(source.view[:KiB])
    assert client.batch_remove(BAD_KEYS) == [Code.INVALID] * len(BAD_KEYS)
    assert client.breaker.state is BreakerState.CLOSED
    assert client.stats().pending == 0


def test_single_key_calls_answer_bad_keys_like_the_batches(client: StoreClient) -> None:
    for key in BAD_KEYS:
        assert client.put(key, b"value") is Code.INVALID
        assert client.get(key) is None
        assert client.exists(key) is False
        assert client.remove(key) is Code.INVALID
    assert client.put("fine", b"value") is Code.OK
    assert client.get("fine") == b"value"


# ----------------------------------------------------------------- A4: what the master refuses


def test_a_batch_the_master_refuses_reports_the_masters_code(client: StoreClient) -> None:
    count = m.MAX_BATCH + 1
    keys = [f"big-{n}" for n in range(count)]
    buffer = _filled(client, 2, 64)
    put = client.batch_put_from(keys, buffer, [0] * count, [8] * count)
    assert set(put.codes) == {Code.INVALID}
    assert set(put.sizes) == {0}
    got = client.batch_get_into(keys, buffer, [0] * count, [8] * count)
    assert set(got.codes) == {Code.INVALID}
    assert client.batch_remove(keys) == [Code.INVALID] * count
    with pytest.raises(StoreError, match="INVALID"):
        client.batch_exists(keys)
    assert client.breaker.state is BreakerState.CLOSED, "a refusal is no sign of an outage"
    assert client.batch_exists(keys[:3]) == [False] * 3
    assert client.stats().pending == 0
    # The limit itself is served (its speed is not the question: a generous deadline).
    fits = keys[: m.MAX_BATCH]
    put = client.batch_put_from(fits, buffer, [0] * len(fits), [8] * len(fits), timeout=60)
    assert set(put.codes) == {Code.OK}
    assert client.batch_remove(fits) == [Code.OK] * len(fits)


def test_a_batch_larger_than_one_master_run_keeps_every_keys_result_in_place(
    client: StoreClient,
) -> None:
    """The client asks the master in runs of MASTER_RUN keys (no call holds the master's one
    thread long); results, bad keys among them, land at their keys, and the bytes are right."""
    count = 2 * MASTER_RUN + 5
    size = 16
    source = _filled(client, 5, count * size)
    keys: list[str] = [f"run-{n}" for n in range(count)]
    for bad in (0, MASTER_RUN - 1, MASTER_RUN, count - 1):
        keys[bad] = ""  # invalid: never sent, INVALID in place
    offsets = [n * size for n in range(count)]
    put = client.batch_put_from(keys, source, offsets, [size] * count, timeout=60)
    expected = [Code.INVALID if key == "" else Code.OK for key in keys]
    assert list(put.codes) == expected
    assert client.batch_exists(keys) == [key != "" for key in keys]
    target = client.register(np.zeros(count * size, dtype=np.uint8))
    reversed_offsets = offsets[::-1]  # each key read into another place than it came from
    got = client.batch_get_into(keys, target, reversed_offsets, [size] * count, timeout=60)
    assert list(got.codes) == expected
    for n, key in enumerate(keys):
        at = reversed_offsets[n]
        want = source.view[n * size : (n + 1) * size] if key else bytes(size)
        assert bytes(target.view[at : at + size]) == bytes(want), key
    assert client.batch_remove(keys, force=True) == expected  # force: the reads' leases
    assert client.stats().pending == 0


def test_keys_adjacent_on_both_sides_move_as_one_request_and_keep_their_own_results(
    client: StoreClient,
) -> None:
    """The master places a batch in one run; keys contiguous in the caller's buffer too are
    one transfer request, yet each key's code, size and bytes are its own."""
    count, size = 64, 4 * KiB
    source = _filled(client, 9, count * size)
    keys = [f"adjacent-{n}" for n in range(count)]
    offsets = [n * size for n in range(count)]
    assert client.put(keys[10], bytes(source.view[10 * size : 11 * size])) == Code.OK

    def ops() -> int:
        return client.engine.stats().transports["shm"].ops

    before = ops()
    put = client.batch_put_from(keys, source, offsets, [size] * count)
    assert put.codes == tuple(Code.EXISTS if n == 10 else Code.OK for n in range(count))
    assert put.sizes == tuple(0 if n == 10 else size for n in range(count))
    assert ops() - before == 2  # the keys before the stored one, and those after it
    target = client.register(np.zeros(count * size, dtype=np.uint8))
    asked = [*keys[:32], "adjacent-absent", *keys[33:]]
    before = ops()
    got = client.batch_get_into(asked, target, offsets, [size] * count)
    assert got.codes == tuple(Code.NOT_FOUND if n == 32 else Code.OK for n in range(count))
    assert ops() - before == 4  # 0-9, 10 (stored on its own), 11-31, 33-63
    for n in range(count):
        want = bytes(size) if n == 32 else bytes(source.view[n * size : (n + 1) * size])
        assert bytes(target.view[n * size : (n + 1) * size]) == want, n
    strided = client.register(np.zeros(2 * count * size, dtype=np.uint8))
    before = ops()
    spread = client.batch_get_into(
        keys, strided, [2 * n * size for n in range(count)], [size] * count
    )
    assert spread.leading() == count
    assert ops() - before == count  # gaps in the caller's buffer: one request per key
    for n in range(count):
        at = 2 * n * size
        assert bytes(strided.view[at : at + size]) == bytes(source.view[n * size : (n + 1) * size])


# ----------------------------------------------------------------------- C12: the contract


def test_invalid_arguments_raise_and_bad_data_is_a_per_key_code(client: StoreClient) -> None:
    buffer = _filled(client, 3, 4 * KiB)
    with pytest.raises(InvalidRequest, match="sizes"):
        client.batch_put_from(["a", "b"], buffer, [0, KiB], [KiB])
    with pytest.raises(InvalidRequest, match="outside"):
        client.batch_get_into(["a"], buffer, [3 * KiB], [2 * KiB])
    with pytest.raises(InvalidRequest, match="integer"):
        client.batch_put_from(["a"], buffer, [0.5], [KiB])  # type: ignore[list-item]
    with pytest.raises(InvalidRequest, match="part"):
        client.batch_put_part_from(
            ["a"], buffer, [0], [KiB], part=2, parts=2, object_sizes=[2 * KiB], object_offsets=[0]
        )
    with pytest.raises(InvalidRequest, match="regions"):
        client.batch_put_from(["a", "b"], [buffer], [0, 0], [1, 1])
    assert client.stats().pending == 0, "nothing reached the master"

    # Bad data per key: a zero size (a put of an empty value too), a key already stored. Sizes
    # are the bytes the call moved: 0 for every key that was not stored or read by it.
    assert client.put("empty", b"") is Code.INVALID
    first = client.batch_put_from(["kept"], buffer, [0], [KiB])
    assert (first.codes, first.sizes) == ((Code.OK,), (KiB,))
    again = client.batch_put_from(["kept", "zero", "new"], buffer, [0, 0, KiB], [KiB, 0, KiB])
    assert again.codes == (Code.EXISTS, Code.INVALID, Code.OK)
    assert again.sizes == (0, 0, KiB)
    assert again.ok() == [True, False, True]
    # Integer-like values are integers (numpy arrays of offsets and sizes).
    target = client.register(np.zeros(4 * KiB, dtype=np.uint8))
    read = client.batch_get_into(
        ["kept", "new", "absent"], target, np.array([0, KiB, 2 * KiB]), np.full(3, KiB)
    )
    assert read.codes == (Code.OK, Code.OK, Code.NOT_FOUND)
    assert read.sizes == (KiB, KiB, 0)
    assert bytes(target.view[: 2 * KiB]) == bytes(buffer.view[: 2 * KiB])


def test_a_put_that_gets_no_space_reports_size_zero(cluster: Cluster) -> None:
    config = StoreClientConfig(master=cluster.master_endpoint)
    with StoreClient(config) as client:
        big = client.register(np.zeros(64 * MiB, dtype=np.uint8))
        result = client.batch_put_from(["huge"], big, [0], [64 * MiB])
        assert (result.codes, result.sizes) == ((Code.NO_SPACE,), (0,))


# ------------------------------------------------------------ C11: falling back to a replica


def _primary(client: StoreClient, key: str) -> str:
    reply = client._call(m.GetReplicas([key], client.engine.segment.host_id))
    assert isinstance(reply, m.ReplicasReply)
    assert len(reply.results[0].locations) == 2
    return reply.results[0].locations[0].segment


@pytest.mark.parametrize(
    ("transport", "fault"),
    [("tcp", signal.SIGKILL), ("tcp", signal.SIGSTOP), ("auto", signal.SIGKILL)],
    ids=["tcp-killed", "tcp-stopped", "shm-killed"],
)
def test_a_read_falls_back_to_the_live_replica(transport: str, fault: signal.Signals) -> None:
    with Cluster(servers=2, server_size=32 * MiB, server_args=FAST_SERVER) as cluster:
        config = StoreClientConfig(master=cluster.master_endpoint, replicas=2)
        over = TransferConfig(transport=transport)  # type: ignore[arg-type]
        with StoreClient(config, over) as writer, StoreClient(config, over) as reader:
            keys = [f"rep-{n}" for n in range(8)]
            source = _filled(writer, 4, 8 * 256 * KiB)
            offsets = [n * 256 * KiB for n in range(8)]
            assert writer.batch_put_from(keys, source, offsets, [256 * KiB] * 8).ok() == [True] * 8
            primary = _primary(reader, keys[0])
            assert all(_primary(reader, key) == primary for key in keys)
            victim = next(s for s in cluster.servers if primary in s.banner)
            _fault(victim, fault)
            # The master still lists the victim (its heartbeat has not expired).
            assert all(s.backlog >= 0 for s in cluster.stats().segments)
            assert len(cluster.stats().segments) == 2

            target = reader.register(np.zeros(source.length, dtype=np.uint8))
            result = reader.batch_get_into(keys, target, offsets, [256 * KiB] * 8, timeout=4.0)
            assert result.codes == (Code.OK,) * 8
            assert result.sizes == (256 * KiB,) * 8
            assert target.view == source.view
            assert reader.get(keys[3], timeout=4.0) == bytes(source.view[offsets[3] : offsets[4]])
            assert reader.batch_exists(keys) == [True] * 8, "no key was negatively cached"


def _fault(victim: Process, fault: signal.Signals) -> None:
    if fault is signal.SIGKILL:
        victim.kill()
    else:
        victim.signal(fault)


# ---------------------------------------------------------- C9: memory still held by a transfer


class _HeldCopies:
    """Makes the local/shared-memory copy path block until released: a transport thread that
    holds its memory past the deadline and the settle grace."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        original: Callable[..., list[Slice]] = Copier.copy

        def copy(copier: Copier, *args: Any, **kwargs: Any) -> list[Slice]:
            self.entered.set()
            self.release.wait()
            return original(copier, *args, **kwargs)

        monkeypatch.setattr(Copier, "copy", copy)
        # Held copies are a transport thread's: none runs inline in the caller.
        monkeypatch.setattr(CopyWorkers, "inline", lambda _workers, _group: False)


@contextlib.contextmanager
def _holding_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[_HeldCopies]:
    """Inside a client's ``with``: its close must not wait for a copy a failed test left held."""
    copies = _HeldCopies(monkeypatch)
    try:
        yield copies
    finally:
        copies.release.set()


class _Registrations:
    """Records what the client's engine registers and unregisters."""

    def __init__(self, client: StoreClient, monkeypatch: pytest.MonkeyPatch) -> None:
        self.registered: list[MemoryRegion] = []
        self.unregistered: list[MemoryRegion] = []
        engine = client.engine
        register, unregister = engine.register, engine.unregister

        def track_register(buffer: object, **kwargs: Any) -> MemoryRegion:
            region = register(buffer, **kwargs)
            self.registered.append(region)
            return region

        def track_unregister(region: MemoryRegion) -> None:
            unregister(region)
            self.unregistered.append(region)

        monkeypatch.setattr(engine, "register", track_register)
        monkeypatch.setattr(engine, "unregister", track_unregister)


@pytest.fixture
def held_cluster() -> Iterator[Cluster]:
    # A put_timeout past the settle grace: the master must not give the put up on its own
    # before the client has answered.
    master = ["--master-put-timeout", "8"]
    with Cluster(servers=1, server_size=16 * MiB, master_args=master) as c:
        yield c


def test_an_unsettled_read_is_reported_and_its_callback_waits_for_the_transport(
    held_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    with StoreClient(StoreClientConfig(master=held_cluster.master_endpoint)) as client:
        value = pattern(5, 64 * KiB).tobytes()
        assert client.put("held", value) is Code.OK
        target = client.register(np.zeros(64 * KiB, dtype=np.uint8))
        with _holding_copies(monkeypatch) as copies:
            result = client.batch_get_into(["held"], target, [0], [64 * KiB], timeout=0.2)
            assert copies.entered.is_set()
            assert (result.codes, result.sizes) == ((Code.UNSETTLED,), (0,))
            settled = threading.Event()
            result.on_settled(settled.set)
            assert not settled.is_set()
            # A failed read: the key is reported absent for a while; the store is still up.
            assert client.batch_exists(["held"]) == [False]
            assert client.breaker.state is BreakerState.CLOSED
            copies.release.set()
            wait_for(settled.is_set, "on_settled did not run once the transport let go")
        assert client.get("held") == value


def test_an_unsettled_get_keeps_its_buffer_registered_until_the_transport_lets_go(
    held_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    with StoreClient(StoreClientConfig(master=held_cluster.master_endpoint)) as client:
        assert client.put("held-get", pattern(7, 64 * KiB).tobytes()) is Code.OK
        tracked = _Registrations(client, monkeypatch)
        with _holding_copies(monkeypatch) as copies:
            assert client.get("held-get", timeout=0.2) is None
            assert copies.entered.is_set()
            assert len(tracked.registered) == 1
            assert tracked.unregistered == [], "get() unregistered memory a transport writes"
            assert client.engine.owns(tracked.registered[0])
            copies.release.set()
            wait_for(lambda: tracked.unregistered == tracked.registered, "get() leaked its region")


def test_an_unsettled_put_is_neither_ended_nor_revoked(
    held_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    with StoreClient(StoreClientConfig(master=held_cluster.master_endpoint)) as client:
        tracked = _Registrations(client, monkeypatch)
        value = pattern(6, 64 * KiB).tobytes()
        with _holding_copies(monkeypatch) as copies:
            assert client.put("late", value, timeout=0.2) is Code.UNSETTLED
            assert copies.entered.is_set()
            stats = client.stats()
            assert stats.pending == 1, "the put was ended or revoked while its write may land"
            assert stats.keys == 0
            assert client.engine.owns(tracked.registered[0])
            assert tracked.unregistered == []
            copies.release.set()
            wait_for(lambda: tracked.unregistered == tracked.registered, "put() leaked its region")
        # The master gives the put up at its put_timeout and quarantines the space.
        wait_for(lambda: client.stats().pending == 0, "the pending put never expired", 20)
        assert client.exists("late") is False
        assert client.put("late", value) is Code.OK
        assert client.get("late") == value


# ------------------------------------------------------------------ a read its caller cancels


def test_a_canceled_read_ends_at_once_with_the_keys_that_arrived() -> None:
    # Server A holds exactly keys 0-2 (full, never evicting), server B keys 3-5, and B stops.
    # Over TCP a stopped server answers nothing; the read is canceled once A's bytes are in.
    size = 64 * KiB
    with Cluster(servers=0, master_args=["--master-high-watermark", "1.0"]) as cluster:
        cluster.add_server("--store-size", str(3 * size))
        config = StoreClientConfig(master=cluster.master_endpoint)
        tcp = TransferConfig(transport="tcp")
        with StoreClient(config, tcp) as writer, StoreClient(config, tcp) as reader:
            keys = [f"cancel-{n}" for n in range(6)]
            offsets = [n * size for n in range(6)]
            source = _filled(writer, 8, 6 * size)
            assert (
                writer.batch_put_from(keys[:3], source, offsets[:3], [size] * 3).ok() == [True] * 3
            )
            stopped = cluster.add_server("--store-size", str(8 * MiB))
            assert (
                writer.batch_put_from(keys[3:], source, offsets[3:], [size] * 3).ok() == [True] * 3
            )
            assert sorted(s.objects for s in cluster.stats().segments) == [3, 3]
            target = reader.register(np.zeros(6 * size, dtype=np.uint8))

            def a_is_in() -> bool:  # counted once the transfers completed
                tcp_stats = reader.engine.stats().transports.get("tcp")
                return tcp_stats is not None and tcp_stats.bytes_read >= 3 * size

            stopped.signal(signal.SIGSTOP)
            try:
                # A deadline far away: only the cancel ends this read early.
                result = reader.batch_get_into(
                    keys, target, offsets, [size] * 6, timeout=30, cancel=a_is_in
                )
                assert result.codes == (Code.OK,) * 3 + (Code.CANCELED,) * 3
                assert result.sizes == (size,) * 3 + (0,) * 3
                assert result.unsettled == (), "the stopped server's transfers were aborted"
                assert target.view[: 3 * size] == source.view[: 3 * size]
                target.view[3 * size :] = b"\xee" * (3 * size)  # the caller reuses the rest
            finally:
                stopped.signal(signal.SIGCONT)
            # Canceled is not failed: the keys are not reported absent, the breaker is closed.
            assert reader.batch_exists(keys) == [True] * 6
            assert reader.breaker.state is BreakerState.CLOSED
            # A read from the resumed server went all the way through it: a late answer to the
            # canceled read would have come before, and it landed nowhere.
            again = reader.register(np.zeros(3 * size, dtype=np.uint8))
            reread = reader.batch_get_into(keys[3:], again, offsets[:3], [size] * 3, timeout=10)
            assert reread.codes == (Code.OK,) * 3
            assert again.view == source.view[3 * size :]
            assert target.view[3 * size :] == b"\xee" * (3 * size)


def test_a_canceled_read_a_transport_cannot_stop_stays_unsettled(
    held_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    with StoreClient(StoreClientConfig(master=held_cluster.master_endpoint)) as client:
        assert client.put("held-cancel", pattern(9, 64 * KiB).tobytes()) is Code.OK
        target = client.register(np.zeros(64 * KiB, dtype=np.uint8))
        with _holding_copies(monkeypatch) as copies:
            result = client.batch_get_into(
                ["held-cancel"], target, [0], [64 * KiB], timeout=0.2, cancel=copies.entered.is_set
            )
            assert copies.entered.is_set()
            assert result.codes == (Code.UNSETTLED,), "canceled, yet a copy still writes it"
            settled = threading.Event()
            result.on_settled(settled.set)
            assert not settled.is_set()
            copies.release.set()
            wait_for(settled.is_set, "on_settled did not run once the copy let go")


# -------------------------------------------------- gathered parts and scattered reads


def _pieces(region: MemoryRegion, starts: list[int], size: int) -> list[Span]:
    return [Span(region, start, size) for start in starts]


def test_parts_gathered_from_scattered_ranges_come_back_scattered_byte_for_byte(
    cluster: Cluster,
) -> None:
    # Two writers (TP ranks) each hold their part of every object as 3 ranges spread over
    # their memory (a block's layers), in an order unlike the memory's.
    config = StoreClientConfig(master=cluster.master_endpoint)
    piece, count = 4 * KiB, 2
    part_bytes = 3 * piece
    with StoreClient(config) as rank0, StoreClient(config) as rank1, StoreClient(config) as reader:
        writers = [rank0, rank1]
        memory = [_filled(w, 20 + n, 16 * piece) for n, w in enumerate(writers)]
        starts = [[5 * piece, 0, 9 * piece], [2 * piece, 11 * piece, 7 * piece]]
        keys = [f"gathered-{n}" for n in range(count)]

        def spans(rank: int, obj: int) -> list[Span]:
            return _pieces(memory[rank], [s + obj * piece for s in starts[rank]], piece)

        def put(rank: int) -> BatchResult:
            return writers[rank].batch_put_gathered(
                keys,
                [spans(rank, obj) for obj in range(count)],
                part=rank,
                parts=2,
                object_sizes=[2 * part_bytes] * count,
                object_offsets=[rank * part_bytes] * count,
            )

        first = put(0)
        assert (first.codes, first.sizes) == ((Code.OK,) * count, (part_bytes,) * count)
        assert reader.batch_exists(keys) == [False] * count, "half an object is readable"
        assert reader.get(keys[0]) is None
        assert put(1).codes == (Code.OK,) * count

        def expected(rank: int, obj: int) -> bytes:
            return b"".join(
                bytes(s.region.view[s.offset : s.offset + s.size]) for s in spans(rank, obj)
            )

        for obj, key in enumerate(keys):
            assert reader.get(key) == expected(0, obj) + expected(1, obj)
        # Each rank reads back only its own part, scattered into ranges of its own order.
        for rank in (0, 1):
            target = reader.register(np.zeros(16 * piece, dtype=np.uint8))
            into = [
                _pieces(target, [(3 * obj + k) * piece for k in (2, 0, 1)], piece)
                for obj in range(count)
            ]
            got = reader.batch_get_scattered(keys, into, object_offsets=[rank * part_bytes] * count)
            assert (got.codes, got.sizes) == ((Code.OK,) * count, (part_bytes,) * count)
            for obj in range(count):
                landed = b"".join(
                    bytes(target.view[s.offset : s.offset + s.size]) for s in into[obj]
                )
                assert landed == expected(rank, obj)
            untouched = np.frombuffer(target.view, dtype=np.uint8)[6 * piece :]
            assert not untouched.any(), "a scattered read wrote outside its spans"
        # One part is stored once: the second put of a complete object is skipped.
        assert put(0).codes == (Code.EXISTS,) * count
        assert reader.stats().pending == 0


def test_gathered_and_scattered_calls_reject_bad_spans_before_anything_is_sent(
    client: StoreClient, cluster: Cluster
) -> None:
    buffer = _filled(client, 21, 8 * KiB)
    with StoreClient(StoreClientConfig(master=cluster.master_endpoint)) as other:
        foreign = other.register(np.zeros(KiB, dtype=np.uint8))
        bad: list[tuple[Any, str]] = [
            ([[]], "non-empty"),
            (["abc"], "non-empty"),
            ([[(buffer, 0)]], "span is"),
            ([[Span(buffer, 7 * KiB, 2 * KiB)]], "outside"),
            ([[Span(buffer, -1, 1)]], "outside"),
            ([[Span(buffer, 0, 0)]], "0 bytes"),
            ([[Span(buffer, 0.5, 1)]], "integer"),
            ([[Span(foreign, 0, 1)]], "not registered"),
            ([[Span([1], 0, 1)]], "not registered"),
            ([[Span(buffer, 0, 1)], [Span(buffer, 0, 1)]], "entries"),
            ([[Span(buffer, 0, 1)] * (MAX_SPANS + 1)], "more than"),
        ]
        for spans, problem in bad:
            with pytest.raises(InvalidRequest, match=problem):
                client.batch_put_gathered(["a"], spans)
            with pytest.raises(InvalidRequest, match=problem):
                client.batch_get_scattered(["a"], spans)
    one = [[Span(buffer, 0, KiB)]]
    with pytest.raises(InvalidRequest, match="outside"):
        client.batch_put_gathered(
            ["a"], one, part=1, parts=2, object_sizes=[KiB], object_offsets=[KiB]
        )
    with pytest.raises(InvalidRequest, match="part"):
        client.batch_put_gathered(
            ["a"], one, part=2, parts=2, object_sizes=[KiB], object_offsets=[0]
        )
    with pytest.raises(InvalidRequest, match="object offset"):
        client.batch_get_scattered(["a"], one, object_offsets=[-1])
    assert client.stats().pending == 0, "nothing reached the master"
    # Bad data per key: a read past the object's end is INVALID and reads nothing.
    assert client.batch_put_gathered(["short", "\ud800"], [one[0], one[0]]).codes == (
        Code.OK,
        Code.INVALID,
    )
    target = client.register(np.full(2 * KiB, 0xEE, dtype=np.uint8))
    past = client.batch_get_scattered(["short"], [[Span(target, 0, KiB)]], object_offsets=[1])
    assert (past.codes, past.sizes) == ((Code.INVALID,), (0,))
    assert bytes(target.view) == b"\xee" * 2 * KiB
    inside = client.batch_get_scattered(
        ["short"], [[Span(target, KiB, 100), Span(target, 0, 24)]], object_offsets=[900]
    )
    assert (inside.codes, inside.sizes) == ((Code.OK,), (124,))
    assert bytes(target.view[KiB : KiB + 100]) == bytes(buffer.view[900:1000])
    assert bytes(target.view[:24]) == bytes(buffer.view[1000:KiB])


def test_an_unsettled_gathered_put_and_scattered_read_hold_every_span(
    held_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    with StoreClient(StoreClientConfig(master=held_cluster.master_endpoint)) as client:
        source = _filled(client, 22, 64 * KiB)
        spans = [_pieces(source, [32 * KiB, 0], 16 * KiB)]
        with _holding_copies(monkeypatch) as copies:
            put = client.batch_put_gathered(["held-parts"], spans, timeout=0.2)
            assert put.codes == (Code.UNSETTLED,)
            assert client.stats().pending == 1, "an unsettled put was ended or revoked"
            settled = threading.Event()
            put.on_settled(settled.set)
            assert not settled.is_set()
            copies.release.set()
            wait_for(settled.is_set, "on_settled did not run once the copies let go")
        wait_for(lambda: client.stats().pending == 0, "the pending put never expired", 20)
        assert client.batch_put_gathered(["held-parts"], spans).codes == (Code.OK,)
        target = client.register(np.zeros(64 * KiB, dtype=np.uint8))
        into = [_pieces(target, [0, 48 * KiB], 16 * KiB)]
        with _holding_copies(monkeypatch) as copies:
            got = client.batch_get_scattered(["held-parts"], into, timeout=0.2)
            assert got.codes == (Code.UNSETTLED,)
            settled = threading.Event()
            got.on_settled(settled.set)
            assert not settled.is_set()
            copies.release.set()
            wait_for(settled.is_set, "on_settled did not run once the copies let go")
        again = client.batch_get_scattered(["held-parts"], into)
        assert again.codes == (Code.OK,)
        assert bytes(target.view[: 16 * KiB]) == bytes(source.view[32 * KiB : 48 * KiB])
        assert bytes(target.view[48 * KiB :]) == bytes(source.view[: 16 * KiB])
