"""The disk tier under real faults: SIGKILL mid-write, and a full file system (a loop-mounted
ext4 image)."""

from __future__ import annotations

import errno
import logging
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconnect.errors import DiskUnavailable, SourceUnavailable
from kvconnect.store.messages import Moved
from tests.support.child import child_env
from tests.support.disk import Collected, demote, new_tier, payload, read
from tests.support.disk_writer import SIZES
from tests.support.loopfs import fill, loop_fs
from tests.support.waiting import wait_for

DONE_BEFORE_KILL = 60


def test_sigkill_mid_write_recovers_every_done_object_and_nothing_partial(tmp_path: Path) -> None:
    path = tmp_path / "tier.data"
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.disk_writer", str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=child_env(),
        text=True,
    )
    done: dict[str, int] = {}
    try:
        assert child.stdout is not None
        for line in child.stdout:
            _, key, offset = line.split()
            done[key] = int(offset)
            if len(done) == DONE_BEFORE_KILL:
                break
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(10)
        assert child.stdout is not None
        assert child.stdin is not None
        child.stdout.close()
        child.stdin.close()
    assert len(done) == DONE_BEFORE_KILL
    with new_tier(path, size=64 << 20) as tier:
        held = {c.key: c for c in tier.open()}
        assert set(done) <= set(held)
        for key, change in held.items():  # also those durable but not reported before the kill
            assert change.size == SIZES[int(key.split("-")[1]) % len(SIZES)]
            assert read(tier, change.offset, change.size) == payload(key, change.size), key
        assert all(held[key].offset == offset for key, offset in done.items())


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB ext4 file system, loop-mounted (root only)."""
    with loop_fs(tmp_path) as (mount, _image):
        yield mount


def test_a_tier_bigger_than_the_disk_is_refused(small_fs: Path) -> None:
    with pytest.raises(DiskUnavailable, match="No space"):
        new_tier(small_fs / "tier.data", size=64 << 20).open()


def test_a_full_disk_takes_the_tier_down_and_serves_nothing_wrong(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = small_fs / "tier.data"
    objects = [(f"{'k' * 900}-{i}", i * 4096, 3000 + i) for i in range(2000)]
    with new_tier(path, size=8 << 20) as tier:
        tier.open()
        collected = Collected(tier)
        collected.wait_demoted([Moved(k, o) for k, o, s in objects[:3] if demote(tier, k, o, s)])
        assert fill(small_fs) == errno.ENOSPC
        for start in range(3, len(objects), 100):  # until the index cannot grow any more
            batch = objects[start : start + 100]
            for key, offset, size in batch:
                demote(tier, key, offset, size)
            wait_for(
                lambda b=batch: collected.settled([Moved(k, o) for k, o, _ in b]),
                "moves not settled",
            )
            if not tier.up:
                break
        assert not tier.up
        out = collected.pull()
        demoted = {m.key for m in out.demoted}
        assert len(out.demoted) + len(out.demote_failed) == start + len(batch)
        assert out.demote_failed
        for _, offset, size in objects:
            with pytest.raises(SourceUnavailable):
                read(tier, offset, size)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert str(path) in errors[0].getMessage()
    assert "ENOSPC" in errors[0].getMessage()
    (small_fs / "ballast").unlink()
    with new_tier(path, size=8 << 20) as tier:
        held = tier.open()
        assert {c.key for c in held} >= demoted
        for change in held:
            assert read(tier, change.offset, change.size) == payload(change.key, change.size)


def test_a_stuck_disk_takes_the_tier_down_and_fails_its_moves(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    path = small_fs / "tier.data"
    with new_tier(path, size=8 << 20, timeout=2.0) as tier:  # ample for a live disk
        tier.open()
        collected = Collected(tier)
        collected.wait_demoted([Moved("before", 0)] if demote(tier, "before", 0, 5000) else [])
        subprocess.run(["fsfreeze", "--freeze", str(small_fs)], check=True)
        try:  # writes block in the kernel until the thaw: the watchdog must notice
            demote(tier, "stuck", 1 << 20, 5000)
            wait_for(lambda: not tier.up, "the tier stayed up")
            assert collected.pull().demote_failed == [Moved("stuck", 1 << 20)]
            with pytest.raises(SourceUnavailable):
                read(tier, 0, 5000)
        finally:
            subprocess.run(["fsfreeze", "--unfreeze", str(small_fs)], check=True)
    # close() waited for the writer, whose write completed after the thaw: still not done.
    assert Moved("stuck", 1 << 20) not in collected.pull().demoted
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "ETIMEDOUT" in errors[0].getMessage()
    assert str(path) in errors[0].getMessage()


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A ramfs mount: a file system that refuses O_DIRECT (root only)."""
    mount = tmp_path / "ram"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "ramfs", "ramfs", str(mount)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a ramfs: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_where_o_direct_is_refused_the_tier_uses_buffered_io(ramfs: Path) -> None:
    path = ramfs / "tier.data"
    objects = [("a", 0, 100_000), ("b", 1 << 20, 4096), ("c", 2 << 20, 3 * 65536 + 1)]
    with new_tier(path) as tier:
        tier.open()
        assert not tier.stats().direct
        Collected(tier).wait_demoted([Moved(k, o) for k, o, s in objects if demote(tier, k, o, s)])
        for key, offset, size in objects:
            assert read(tier, offset, size) == payload(key, size)
        assert read(tier, 65530, 20) == payload("a", 100_000)[65530:65550]
    with new_tier(path) as tier:
        assert [c.key for c in tier.open()] == ["a", "b", "c"]
        assert read(tier, 2 << 20, 3 * 65536 + 1) == payload("c", 3 * 65536 + 1)
