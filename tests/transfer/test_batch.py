"""Pure logic: batch state machine, slicing, frame planning."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconnect.errors import AccessDenied, TransferError, TransferTimeout
from kvconnect.transfer import TransferOp, TransferRequest, TransferStatus
from kvconnect.transfer.batch import (
    BatchState,
    DeadlineWatch,
    Slice,
    TransferBatch,
    complete_slices,
    make_slices,
    pin_slices,
    unpin_slices,
)
from kvconnect.transfer.datapath.copying import group_slices
from kvconnect.transfer.memory import MemoryRegistry
from kvconnect.transfer.transports.tcp import plan_frames

REGISTRY = MemoryRegistry()
REGION = REGISTRY.register(bytearray(1 << 20))


def _batch(
    count: int = 2, deadline: float = 60.0, slices: tuple[int, ...] = ()
) -> tuple[BatchState, TransferBatch, list[bool]]:
    """A batch (its state, its caller's handle) whose request i has slices[i] slices (default
    1) of 10 bytes."""
    settled: list[bool] = []
    sizes = [10 * n for n in slices] or [10] * count
    requests = [TransferRequest(REGION, 0, "peer", 1, 0, n) for n in sizes]
    state = BatchState(
        TransferOp.READ,
        requests,
        time.monotonic() + deadline,
        10,
        lambda: settled.append(True),
        settle_grace=1.0,
    )
    return state, TransferBatch(state), settled


def _piece(state: BatchState, index: int) -> Slice:
    return make_slices(state, index, state.requests[index], 10)[0]


def test_request_completes_when_all_its_slices_do() -> None:
    state, batch, settled = _batch(slices=(3,))
    pieces = make_slices(state, 0, batch.requests[0], 10)
    assert len(pieces) == 3
    complete_slices(pieces[:2])
    assert batch.statuses == (TransferStatus.PENDING,)
    pieces[2].done()
    assert batch.wait(0) == (TransferStatus.COMPLETED,)
    assert batch.done()
    assert settled == [True]


def test_first_failure_is_final_and_later_slices_are_ignored() -> None:
    state, batch, settled = _batch(slices=(2, 1))
    error = AccessDenied("no")
    state.complete([0], error)
    state.complete([0], None)
    state.complete([1], None)
    assert batch.wait(0) == (TransferStatus.FAILED, TransferStatus.COMPLETED)
    assert batch.errors[0] is error
    with pytest.raises(TransferError, match="1 of 2") as info:
        batch.raise_for_status()
    assert info.value.__cause__ is error
    assert settled == [True]


def test_deadline_turns_pending_into_timeout_and_aborts_pinned_access() -> None:
    state, batch, settled = _batch(1, deadline=0.05)
    piece = _piece(state, 0)
    aborted: list[bool] = []

    def abort() -> None:
        aborted.append(True)
        unpin_slices([piece], abort)  # the interrupted I/O lets go, as a shut socket makes it

    assert pin_slices([piece], abort) == [piece]
    start = time.monotonic()
    assert batch.wait() == (TransferStatus.TIMEOUT,)
    assert 0.04 < time.monotonic() - start < 2
    assert aborted == [True]
    assert isinstance(batch.errors[0], TransferTimeout)
    assert pin_slices([piece]) == [], "a final request must refuse new access"
    piece.done()  # a late completion changes nothing
    assert batch.statuses == (TransferStatus.TIMEOUT,)
    assert settled == [True]
    with pytest.raises(TransferTimeout):
        batch.raise_for_status()


def test_wait_with_short_timeout_returns_pending() -> None:
    _, batch, _ = _batch(1)
    assert batch.wait(0.01) == (TransferStatus.PENDING,)
    batch.cancel()
    assert batch.wait() == (TransferStatus.CANCELED,)


def test_settling_waits_for_pins_even_after_failure() -> None:
    state, batch, settled = _batch(slices=(2,))
    piece = _piece(state, 0)
    assert pin_slices([piece]) == [piece]
    piece.done(AccessDenied("x"))
    assert batch.statuses == (TransferStatus.PENDING,)  # final, but memory still in use
    assert not batch.done()
    assert settled == []
    unpin_slices([piece])
    assert batch.done()
    assert batch.statuses == (TransferStatus.FAILED,)
    assert settled == [True]


def test_deadline_watch_expires_unwatched_batches() -> None:
    watch = DeadlineWatch()
    watch.start()
    try:
        state, batch, settled = _batch(1, deadline=0.05)
        watch.add(state)
        end = time.monotonic() + 5
        while not batch.done() and time.monotonic() < end:
            time.sleep(0.01)
        assert batch.statuses == (TransferStatus.TIMEOUT,)
        assert settled == [True]
    finally:
        watch.close()


@given(
    lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=40),
    slice_bytes=st.integers(1, 3000),
    max_entries=st.integers(1, 8),
)
def test_slices_cover_requests_and_frames_respect_limits(
    lengths: list[int], slice_bytes: int, max_entries: int
) -> None:
    requests = [TransferRequest(REGION, 7, "peer", 1, 11, n) for n in lengths]
    state = BatchState(
        TransferOp.WRITE,
        requests,
        time.monotonic() + 60,
        slice_bytes,
        lambda: None,
        settle_grace=1.0,
    )
    slices = []
    for index, request in enumerate(requests):
        pieces = make_slices(state, index, request, slice_bytes)
        assert len(pieces) == state._remaining[index]
        assert sum(p.length for p in pieces) == request.length
        assert all(0 < p.length <= slice_bytes for p in pieces)
        # contiguous, same displacement locally and remotely
        offset = 0
        for p in pieces:
            assert (p.local_offset, p.remote_offset) == (7 + offset, 11 + offset)
            offset += p.length
        slices += pieces
    frames = plan_frames(TransferOp.WRITE, slices, slice_bytes, max_entries)
    assert [p for f in frames for p in f.slices] == slices
    for frame in frames:
        assert 1 <= len(frame.slices) <= max_entries
        assert len(frame.slices) == 1 or sum(p.length for p in frame.slices) <= slice_bytes
    groups = list(group_slices(slices, 4 * slice_bytes))
    assert [p for g in groups for p in g] == slices


def test_a_final_but_pinned_request_is_reported_pending() -> None:
    state, batch, _ = _batch(slices=(2,))
    piece = _piece(state, 0)
    assert pin_slices([piece]) == [piece]
    piece.done(AccessDenied("x"))
    assert batch.wait(0.01) == (TransferStatus.PENDING,), "memory is still in use"
    assert batch.statuses == (TransferStatus.PENDING,)
    unpin_slices([piece])
    assert batch.wait(0) == (TransferStatus.FAILED,)


def test_a_batch_is_done_only_once_the_engine_let_go_of_its_regions() -> None:
    # The transport thread settles the last request, then the engine releases the regions
    # (on_settled). A caller woken in between and unregistering at once would find them busy.
    releasing, release = threading.Event(), threading.Event()
    order: list[str] = []

    def on_settled() -> None:
        releasing.set()
        release.wait(10)
        order.append("released")

    requests = [TransferRequest(REGION, 0, "peer", 1, 0, 10)]
    state = BatchState(
        TransferOp.READ, requests, time.monotonic() + 60, 10, on_settled, settle_grace=1.0
    )
    batch = TransferBatch(state)
    finisher = threading.Thread(target=make_slices(state, 0, requests[0], 10)[0].done)
    finisher.start()
    assert releasing.wait(10)
    assert batch.wait(0.2) == (TransferStatus.COMPLETED,)  # final, but not released yet
    assert not batch.done()
    batch.add_settled_callback(lambda: order.append("callback"))
    assert order == []
    release.set()
    finisher.join(10)
    assert batch.done()
    assert order == ["released", "callback"]
