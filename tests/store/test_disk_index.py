"""The disk index log and the extent table: replay, torn tails, overlaps, compaction (pure or
on real files in tmp_path)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvconnect.store.disk.checksum import CHUNK, chunk_crcs
from kvconnect.store.disk.extents import Extents
from kvconnect.store.disk.index import IndexLog, Record, encode_del, encode_put, replay

SIZE = 64 << 20


def rec(key: str, offset: int, size: int) -> Record:
    return Record(key, offset, size, chunk_crcs(memoryview(bytes(size))))


def write_log(path: Path, records: list[bytes]) -> None:
    log, _ = IndexLog.open(path, SIZE)
    log.append(records)
    log.sync()
    log.close()


def test_replay_keeps_puts_in_offset_order_and_applies_dels(tmp_path: Path) -> None:
    path = tmp_path / "t.index"
    write_log(
        path,
        [
            encode_put(rec("b", 1 << 19, 100)),
            encode_put(rec("a", 0, CHUNK * 2 + 1)),
            encode_put(rec("c", 1 << 20, 5)),
            encode_del(1 << 20),
        ],
    )
    log, result = IndexLog.open(path, SIZE)
    log.close()
    assert result.records == [rec("a", 0, CHUNK * 2 + 1), rec("b", 1 << 19, 100)]
    assert result.entries == 4
    assert result.valid == path.stat().st_size


@pytest.mark.parametrize("cut", [1, 10, 24, 30])
def test_a_torn_tail_recovers_the_prefix_and_is_truncated(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "t.index"
    write_log(path, [encode_put(rec("a", 0, 100)), encode_put(rec("b", 4096, CHUNK + 7))])
    full = path.stat().st_size
    os.truncate(path, full - cut)
    log, result = IndexLog.open(path, SIZE)
    log.close()
    assert [r.key for r in result.records] == ["a"]
    assert path.stat().st_size == result.valid < full - cut


def test_replay_stops_at_a_corrupt_record(tmp_path: Path) -> None:
    records = [encode_put(rec(k, i * 4096, 10)) for i, k in enumerate("abc")]
    path = tmp_path / "t.index"
    write_log(path, records)
    data = bytearray(path.read_bytes())
    data[16 + len(records[0]) + 24] ^= 1  # b's key
    result = replay(bytes(data), SIZE)
    assert [r.key for r in result.records] == ["a"]
    assert result.valid == 16 + len(records[0])


def test_overlaps_and_repeated_keys_the_later_record_wins() -> None:
    head = bytes(16)
    log = [
        encode_put(rec("a", 0, 3 * 4096)),
        encode_put(rec("b", 4096, 100)),  # inside a: a dropped
        encode_put(rec("c", 8192, 4096)),  # overlaps nothing left
        encode_put(rec("d", 1 << 20, 10)),
        encode_put(rec("d", 2 << 20, 10)),  # d again: the later wins
        encode_put(rec("e", 40 << 20, 30 << 20)),  # beyond the file
        encode_put(rec("f", 100, 10)),  # not on a block boundary
    ]
    result = replay(head + b"".join(log), SIZE)
    assert [(r.key, r.offset) for r in result.records] == [("b", 4096), ("c", 8192), ("d", 2 << 20)]
    assert result.dropped == 4  # a, the first d, e, f


def test_an_earlier_record_loses_to_a_later_one_it_overlaps_from_below() -> None:
    log = [encode_put(rec("late", 8192, 4096)), encode_put(rec("early", 4096, 3 * 4096))]
    result = replay(bytes(16) + b"".join(log), SIZE)
    assert [r.key for r in result.records] == ["early"]


def test_compaction_keeps_the_live_records(tmp_path: Path) -> None:
    path = tmp_path / "t.index"
    live = [rec(f"k{i}", i * 4096, 3000) for i in range(50)]
    churn = [encode_put(rec("x", 1 << 20, 10)), encode_del(1 << 20)] * 200
    log, _ = IndexLog.open(path, SIZE)
    log.append(churn + [encode_put(r) for r in live])
    log.sync()
    before = log.length
    log.compact(live)
    log.append([encode_del(0)])
    log.sync()
    assert log.length < before
    log.close()
    reopened, result = IndexLog.open(path, SIZE)
    reopened.close()
    assert result.records == live[1:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.index"]


def test_an_index_of_another_kind_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.index"
    path.write_bytes(b"something else entirely")
    with pytest.raises(ValueError, match="not a kvconnect disk index"):
        IndexLog.open(path, SIZE)


def test_extents_find_the_object_covering_any_byte() -> None:
    extents = Extents()
    objects = [rec("a", 0, 4096), rec("big", 4096, 3 << 20), rec("c", (3 << 20) + 8192, 10)]
    for r in objects:
        extents.add(r)
    assert extents.covering(4095) == objects[0]
    assert extents.covering(4096 + (2 << 20) + 5) == objects[1]
    assert extents.covering((3 << 20) + 4096) is None  # the gap
    assert extents.covering((3 << 20) + 8192 + 9) == objects[2]
    assert extents.covering((3 << 20) + 8192 + 10) is None
    assert {r.key for r in extents.overlapping(4000, 2 << 20)} == {"a", "big"}
    assert extents.remove(4096) == objects[1]
    assert extents.covering(5000) is None
    assert extents.overlapping(4096, 3 << 20) == []
    assert len(extents) == 2


def test_extents_loaded_in_bulk_answer_as_added_ones() -> None:
    objects = [rec(f"k{i}", i * (700 << 10), (i % 3 + 1) * (300 << 10)) for i in range(40)]
    added, loaded = Extents(), Extents()
    for r in objects:
        added.add(r)
    loaded.load(objects)
    for probe in range(0, 40 * (700 << 10), 37 << 10):
        assert added.covering(probe) == loaded.covering(probe), probe
    assert loaded.remove(objects[5].offset) == objects[5]
    assert loaded.covering(objects[5].offset) is None
