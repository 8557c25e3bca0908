"""DiskTier on real files in tmp_path: demotions, verified reads, recovery, integrity, loads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvconnect.errors import DiskUnavailable, SourceUnavailable
from kvconnect.store.disk.checksum import CHUNK
from kvconnect.store.disk.files import aligned_buffer
from kvconnect.store.disk.reading import WINDOW
from kvconnect.store.disk.tier import DiskTier, _runs, _Write
from kvconnect.store.messages import Change, Moved
from tests.support.disk import Collected, demote, new_tier, payload, read, release
from tests.support.waiting import wait_for

# Sizes around the 64 KiB chunk and 4 KiB block boundaries, and one of several chunks.
SIZES = [1, 4096, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 123]


MiB = 1 << 20


def place(sizes: list[int], first: int = 0) -> list[tuple[str, int, int]]:
    """(key, offset, size) for consecutive objects on 4 KiB boundaries."""
    out, offset = [], first
    for i, size in enumerate(sizes):
        out.append((f"obj-{i}-{size}", offset, size))
        offset += -(-size // 4096) * 4096
    return out


def demote_all(tier: DiskTier, objects: list[tuple[str, int, int]]) -> Collected:
    collected = Collected(tier)
    for key, offset, size in objects:
        assert demote(tier, key, offset, size)
    collected.wait_demoted([Moved(key, offset) for key, offset, _ in objects])
    return collected


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "tier.data"


def test_demoted_objects_read_back_byte_for_byte_whole_and_in_ranges(path: Path) -> None:
    objects = place(SIZES)
    with new_tier(path) as tier:
        assert tier.open() == []
        demote_all(tier, objects)
        for key, offset, size in objects:
            data = payload(key, size)
            assert read(tier, offset, size) == data
            for a, b in [(0, 1), (size - 1, size), (CHUNK - 10, CHUNK + 10), (1, size - 1)]:
                lo, hi = max(0, min(a, size)), max(0, min(b, size))
                if lo < hi:
                    assert read(tier, offset + lo, hi - lo) == data[lo:hi], (key, lo, hi)
        stats = tier.stats()
        assert stats.objects == len(objects)
        assert stats.used == sum(SIZES)
        assert stats.demotions == len(objects)
        assert stats.up
        assert stats.queue_bytes == 0


def test_an_object_larger_than_a_read_window_reads_back_across_windows(path: Path) -> None:
    size = 2 * WINDOW + 3 * CHUNK + 17
    with new_tier(path, size=64 << 20, queue=32 << 20) as tier:
        tier.open()
        demote_all(tier, [("large", 4096, size)])
        data = payload("large", size)
        assert read(tier, 4096, size) == data
        lo = WINDOW - 100
        assert read(tier, 4096 + lo, WINDOW + 200) == data[lo : lo + WINDOW + 200]


def test_a_read_outside_every_object_is_refused(path: Path) -> None:
    with new_tier(path) as tier:
        tier.open()
        demote_all(tier, [("k", 8192, 5000)])
        for offset, size in [(0, 10), (8192, 5001), (8192 + 5000, 1), (4096, 4097)]:
            with pytest.raises(SourceUnavailable):
                read(tier, offset, size)


def test_objects_survive_close_and_reopen(path: Path) -> None:
    objects = place(SIZES, first=1 << 20)
    with new_tier(path) as tier:
        tier.open()
        demote_all(tier, objects)
        assert release(tier, objects[0][1])
    with new_tier(path) as tier:
        held = tier.open()
        assert held == [Change(k, o, s) for k, o, s in objects[1:]]
        for key, offset, size in objects[1:]:
            assert read(tier, offset, size) == payload(key, size)
        assert tier.stats().recovered == len(objects) - 1


def test_a_second_tier_on_the_same_file_is_refused(path: Path) -> None:
    with new_tier(path) as tier:
        tier.open()
        with pytest.raises(DiskUnavailable, match="in use"):
            new_tier(path).open()


def test_a_flipped_byte_is_never_served_and_the_object_is_lost(path: Path) -> None:
    key, offset, size = "victim", 0, 3 * CHUNK
    with new_tier(path) as tier:
        tier.open()
        collected = demote_all(tier, [(key, offset, size), ("other", 4 * CHUNK, 100)])
        with open(path, "r+b") as f:  # flip one byte of the second chunk
            f.seek(offset + CHUNK + 77)
            byte = f.read(1)
            f.seek(offset + CHUNK + 77)
            f.write(bytes([byte[0] ^ 0x40]))
        assert read(tier, offset, 100) == payload(key, size)[:100]  # chunk 0 still verifies
        with pytest.raises(SourceUnavailable, match="checksum"):
            read(tier, offset, size)
        assert collected.pull().lost == [Moved(key, offset)]
        with pytest.raises(SourceUnavailable):
            read(tier, offset, 100)  # never served again, not even the good chunk
        stats = tier.stats()
        assert (stats.checksum_failures, stats.lost, stats.objects) == (1, 1, 1)
        assert read(tier, 4 * CHUNK, 100) == payload("other", 100)
    with new_tier(path) as tier:
        assert [c.key for c in tier.open()] == ["other"]  # the loss is durable


def test_a_release_while_the_write_is_in_flight_waits_for_it(path: Path) -> None:
    with new_tier(path) as tier:
        tier.open()
        collected = Collected(tier)
        for i in range(12):
            offset = i * (1 << 20)
            assert demote(tier, f"k{i}", offset, 1 << 20)
            while not release(tier, offset):  # not while the write is in flight
                pass
            assert Moved(f"k{i}", offset) in collected.pull().demoted  # it was done first
        assert tier.stats().objects == 0
    with new_tier(path) as tier:
        assert tier.open() == []


def test_a_release_while_a_load_is_in_flight_waits_for_it(path: Path) -> None:
    size = 2 * WINDOW
    with new_tier(path, size=64 << 20, queue=32 << 20) as tier:
        tier.open()
        collected = demote_all(tier, [(f"k{i}", i * size, size) for i in range(3)])
        dst = bytearray(size)
        for i in range(3):
            tier.load(f"k{i}", i * size, size, memoryview(dst), token=i)
            while not release(tier, i * size):  # not while the load is queued or running
                pass
            assert Moved(f"k{i}", i) in collected.pull().loaded  # it was done first
            assert bytes(dst) == payload(f"k{i}", size)


def test_a_move_bigger_than_the_queue_fails_at_once(path: Path) -> None:
    with new_tier(path, queue=64 << 10) as tier:
        tier.open()
        assert demote(tier, "big", 0, (64 << 10) + 1)
        assert tier.take_outcomes().demote_failed == [Moved("big", 0)]
        assert demote(tier, "past-the-end", tier.size - 4096, 4097)
        assert tier.take_outcomes().demote_failed == [Moved("past-the-end", tier.size - 4096)]
        assert tier.stats().demotions_failed == 2


def test_compaction_keeps_every_live_object(path: Path) -> None:
    long = "k" * 1000  # 1 KiB records: the log passes the compaction floor in a few rounds
    with new_tier(path) as tier:
        tier.open()
        for round_ in range(12):
            objects = [(f"{long}-{round_}-{i}", i * 8192, 4000 + i) for i in range(100)]
            demote_all(tier, objects)
            if round_ < 11:
                for _, offset, _ in objects:
                    assert release(tier, offset)
        wait_for(lambda: tier.stats().compactions >= 1, "no compaction")
        for key, offset, size in objects:
            assert read(tier, offset, size) == payload(key, size)
        assert tier.stats().index_bytes < 1 << 20
    with new_tier(path) as tier:
        assert tier.open() == [Change(k, o, s) for k, o, s in objects]
        for key, offset, size in objects:
            assert read(tier, offset, size) == payload(key, size)


def test_a_promotion_loads_verified_bytes_into_dram(path: Path) -> None:
    size = 2 * CHUNK + 5
    with new_tier(path) as tier:
        tier.open()
        collected = demote_all(tier, [("hot", 0, size), ("bad", 4 * CHUNK, size)])
        with open(path, "r+b") as f:
            f.seek(4 * CHUNK + 3)
            f.write(b"\xff\x00\xff")
        dst = bytearray(3 * size)
        tier.load("hot", 0, size, memoryview(dst)[size : 2 * size], token=12345)
        tier.load("bad", 4 * CHUNK, size, memoryview(dst)[2 * size :], token=999)
        tier.load("absent", 8 * CHUNK, size, memoryview(dst)[:size], token=1)
        wait_for(
            lambda: len(collected.pull().loaded) + len(collected.all.load_failed) == 3,
            "loads not settled",
        )
        assert collected.all.loaded == [Moved("hot", 12345)]
        assert set(collected.all.load_failed) == {Moved("absent", 1), Moved("bad", 999)}
        assert bytes(dst[size : 2 * size]) == payload("hot", size)
        assert bytes(dst[:size]) == bytes(size)  # nothing landed for the failed loads
        assert bytes(dst[2 * size :]) == bytes(size)
        assert collected.all.lost == [Moved("bad", 4 * CHUNK)]


def test_a_removed_data_file_takes_the_tier_down(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with new_tier(path) as tier:
        tier.open()
        collected = demote_all(tier, [("k", 0, 10000)])
        path.unlink()
        wait_for(lambda: not tier.up, "the tier stayed up")
        with pytest.raises(SourceUnavailable, match="down"):
            read(tier, 0, 10000)
        assert demote(tier, "late", 1 << 20, 100)
        assert collected.pull().demote_failed == [Moved("late", 1 << 20)]
        assert release(tier, 0)  # a release still succeeds: forgotten in memory
        assert not tier.stats().up
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert str(path) in errors[0].getMessage()
    assert "ENOENT" in errors[0].getMessage()


def test_a_truncated_data_file_serves_no_bytes(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with new_tier(path) as tier:
        tier.open()
        demote_all(tier, [("k", 1 << 20, 10000)])
        os.truncate(path, 4096)
        with pytest.raises(SourceUnavailable):
            read(tier, 1 << 20, 10000)
        wait_for(lambda: not tier.up, "the tier stayed up")
        assert tier.stats().read_errors + tier.stats().checksum_failures <= 1
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert str(path) in errors[0].getMessage()


def test_adjacent_moves_are_written_in_runs_below_the_kernels_limits() -> None:
    """One call writes a run of adjacent moves: never more buffers than the kernel takes
    (IOV_MAX, 1024) nor more than 8 MiB, and a gap always starts a new run."""
    jobs = [_Write(f"k{n}", n * 4096, 4096, aligned_buffer(4096), b"") for n in range(1500)]
    gap = _Write("far", 1 << 30, MiB, aligned_buffer(MiB), b"")
    runs = _runs([gap, *reversed(jobs)])
    assert [job for run in runs for job in run] == [*jobs, gap]
    assert all(len(run) <= 256 and sum(len(j.buffer) for j in run) <= 8 * MiB for run in runs)
    assert runs[-1] == [gap]
    big = [_Write(f"b{n}", n * MiB, MiB, aligned_buffer(MiB), b"") for n in range(20)]
    assert [len(run) for run in _runs(big)] == [8, 8, 4]
