"""Lanes: a lane whose jobs hang holds only its own threads; queued jobs wait for a free one."""

from __future__ import annotations

import threading

import pytest

from kvconnect.errors import ClosedError
from kvconnect.vllm.lanes import Lanes


def test_a_hung_lane_holds_only_its_own_threads() -> None:
    release = threading.Event()
    started = threading.Semaphore(0)
    ran: list[str] = []
    exits: list[str] = []
    lanes = Lanes("test", 2, on_exit=lambda: exits.append(threading.current_thread().name))

    def hang() -> None:
        started.release()
        release.wait()
        ran.append("stuck")

    try:
        for _ in range(3):  # one more than the lane has threads: it queues
            lanes.submit("stuck", hang)
        for _ in range(2):
            assert started.acquire(timeout=10), "the lane's two threads run its first jobs"
        done = threading.Event()
        lanes.submit("other", done.set)
        assert done.wait(timeout=10), "another lane runs at once"
        assert lanes.busy("stuck")
        assert not started.acquire(timeout=0), "the third job waits for a thread of its lane"
        release.set()
        assert started.acquire(timeout=10), "then it runs"
    finally:
        release.set()
        lanes.close()
    assert ran == ["stuck"] * 3
    assert not lanes.busy("stuck")
    assert len(exits) == 3, "two threads of 'stuck' and one of 'other' ended, each cleaned up"
    with pytest.raises(ClosedError):
        lanes.submit("other", done.set)


def test_close_drops_queued_jobs_and_waits_for_running_ones() -> None:
    release = threading.Event()
    started = threading.Event()
    ran: list[int] = []
    lanes = Lanes("test", 1)

    def first() -> None:
        started.set()
        release.wait()
        ran.append(1)

    lanes.submit("lane", first)
    lanes.submit("lane", lambda: ran.append(2))
    assert started.wait(timeout=10)
    closer = threading.Thread(target=lanes.close)
    closer.start()
    release.set()
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert ran == [1], "the running job finished, the queued one was dropped"
