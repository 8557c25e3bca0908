"""A PD read's phases (kvconnect/vllm/trace.py): pure, every environment."""

from __future__ import annotations

import pytest

from kvconnect.vllm import trace as trace_module
from kvconnect.vllm.trace import Phase, ReadTrace, parse_line


def _clock(monkeypatch: pytest.MonkeyPatch, *times: float) -> None:
    ticks = iter(times)
    monkeypatch.setattr(trace_module, "_now", lambda: next(ticks))


def test_each_phase_lasts_from_the_previous_stamp_to_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _clock(monkeypatch, 10.0, 10.001, 10.003, 10.0031, 10.0131, 10.0141, 10.0171)
    trace = ReadTrace.begin()
    for phase in Phase:
        trace.stamp(phase)
    assert trace.seconds() == pytest.approx(
        {
            Phase.QUEUE: 0.001,
            Phase.LAYOUT: 0.002,
            Phase.PLAN: 0.0001,
            Phase.READ: 0.01,
            Phase.CONFIRM: 0.001,
            Phase.COLLECT: 0.003,
        }
    )
    assert trace.stats()["pd_phase_read_seconds"] == pytest.approx(0.01)
    assert set(trace.stats()) == {f"pd_phase_{p}_seconds" for p in Phase}


def test_a_phase_never_reached_is_left_out_and_the_next_spans_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _clock(monkeypatch, 1.0, 1.5, 3.0)  # the layout failed: no plan, read or confirmation
    trace = ReadTrace.begin()
    trace.stamp(Phase.QUEUE)
    trace.stamp(Phase.COLLECT)
    assert trace.seconds() == {Phase.QUEUE: 0.5, Phase.COLLECT: 1.5}


def test_the_debug_line_reads_back(monkeypatch: pytest.MonkeyPatch) -> None:
    _clock(monkeypatch, 2.0, 2.25, 2.5)
    trace = ReadTrace.begin()
    trace.stamp(Phase.QUEUE)
    trace.stamp(Phase.READ)
    line = "DEBUG 2026-12-01 [kvconnect.vllm.worker] " + trace.line("cmpl-1-0", 4096, True)
    assert parse_line(line) == {
        "ok": 1.0,
        "bytes": 4096.0,
        "queue_ms": 250.0,
        "read_ms": 250.0,
        "total_ms": 500.0,
    }
    assert parse_line(trace.line("r", 0, False))["ok"] == 0.0  # type: ignore[index]
    assert parse_line("INFO KV Transfer metrics: pd_reads=1") is None
