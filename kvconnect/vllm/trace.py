"""Where a PD read's time goes: one timestamp per phase, from the step that planned it to the
step that reported it to vLLM.

The worker stamps a :class:`ReadTrace` as the read moves on (monotonic clock) and, once vLLM
collected the result, adds its phases to the worker's stats (``pd_phase_<phase>_seconds``, summed
like every counter) and logs them as one debug line (:data:`TRACE_PREFIX`), which
``kvconnect bench vllm --phases`` reads back. Pure: no vLLM, no I/O.
"""

from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass, field


class Phase(enum.StrEnum):
    """The phases of one read, in order (each ends at its own stamp)."""

    QUEUE = "queue"  # planned by start_load_kv → its lane thread took it
    LAYOUT = "layout"  # the prefill rank's layout (a side-channel call at first contact)
    PLAN = "plan"  # the transfer requests built
    READ = "read"  # the batched READ (every byte in)
    CONFIRM = "confirm"  # prefill acknowledged the read (it may free its blocks)
    COLLECT = "collect"  # reported → vLLM's next get_finished took it (finished_recving)


TRACE_PREFIX = "kvconnect read trace"
_FIELD = re.compile(r"(\w+)=([0-9.]+)")


def _now() -> float:
    return time.monotonic()


@dataclass(slots=True)
class ReadTrace:
    """Timestamps of one read; ``queued`` is when the worker got its plan."""

    queued: float
    stamps: dict[Phase, float] = field(default_factory=dict)

    @classmethod
    def begin(cls) -> ReadTrace:
        """A trace whose read was planned now."""
        return cls(_now())

    def stamp(self, phase: Phase) -> None:
        """``phase`` ends now."""
        self.stamps[phase] = _now()

    def seconds(self) -> dict[Phase, float]:
        """Each stamped phase's duration (a phase not stamped — the read failed before it —
        is left out; the next stamped one then spans both)."""
        durations: dict[Phase, float] = {}
        last = self.queued
        for phase in Phase:
            end = self.stamps.get(phase)
            if end is not None:
                durations[phase] = max(0.0, end - last)
                last = end
        return durations

    def stats(self) -> dict[str, float]:
        """The phases as worker-stats counters (``pd_phase_<phase>_seconds``)."""
        return {f"pd_phase_{phase}_seconds": value for phase, value in self.seconds().items()}

    def line(self, request_id: str, nbytes: int, ok: bool) -> str:
        """The debug line :func:`parse_line` reads back."""
        spans = " ".join(f"{p}_ms={1000 * s:.3f}" for p, s in self.seconds().items())
        total = 1000 * (max(self.stamps.values(), default=self.queued) - self.queued)
        return (
            f"{TRACE_PREFIX} {request_id}: ok={int(ok)} bytes={nbytes} {spans} total_ms={total:.3f}"
        )


def parse_line(line: str) -> dict[str, float] | None:
    """The numbers of a :meth:`ReadTrace.line` found in ``line`` (a log line), else None."""
    at = line.find(TRACE_PREFIX)
    if at < 0:
        return None
    return {key: float(value) for key, value in _FIELD.findall(line[at:])}
