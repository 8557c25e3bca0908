"""Pure parts of the RDMA transport: the RC queue-pair state machine and work-request planning.

No verbs here: the driver produces :class:`QpStep` values (target state, attribute fields, the
attribute-mask names they need) that ``rdma_verbs`` applies to a real queue pair, so the order
and content of INIT→RTR→RTS are tested without a device.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvconnect.errors import BrokenError
from kvconnect.transfer.protocol.wire import RdmaPath

MAX_RETRY_CNT: Final = 6  # 7 means "retry forever" (rxe honours that): a dead peer would hang
ACK_TIMEOUT: Final = 14  # 4.096 µs * 2^14 ≈ 67 ms per try: a dead peer is noticed in < 1 s
RNR_RETRY: Final = 7  # RDMA READ/WRITE never wait for receive buffers; irrelevant but legal
RD_ATOMIC: Final = 16  # outstanding RDMA READs per QP (capped by the device's limit)


class QpState(enum.Enum):
    """The states this driver uses (verbs has SQD/SQE too; we never enter them)."""

    RESET = "reset"
    INIT = "init"
    RTR = "rtr"
    RTS = "rts"
    ERR = "err"


_NEXT: Final = {QpState.RESET: QpState.INIT, QpState.INIT: QpState.RTR, QpState.RTR: QpState.RTS}


@dataclass(frozen=True, slots=True)
class AddressVector:
    """Route to the remote port: RoCE needs the global route (``is_global``) and a GID."""

    dgid: bytes
    sgid_index: int
    port: int
    hop_limit: int = 64


@dataclass(frozen=True, slots=True)
class QpStep:
    """One ``modify_qp`` call: the target state, attribute values and their mask names."""

    state: QpState
    fields: dict[str, int] = field(default_factory=dict)
    av: AddressVector | None = None

    @property
    def mask(self) -> tuple[str, ...]:
        """Names of ``IBV_QP_*`` mask bits this step sets (``STATE`` first)."""
        names = ["STATE", *(_MASK_NAMES[name] for name in self.fields)]
        if self.av is not None:
            names.append("AV")
        return tuple(names)


_MASK_NAMES: Final = {
    "pkey_index": "PKEY_INDEX",
    "port_num": "PORT",
    "qp_access_flags": "ACCESS_FLAGS",
    "path_mtu": "PATH_MTU",
    "dest_qp_num": "DEST_QPN",
    "rq_psn": "RQ_PSN",
    "max_dest_rd_atomic": "MAX_DEST_RD_ATOMIC",
    "min_rnr_timer": "MIN_RNR_TIMER",
    "sq_psn": "SQ_PSN",
    "timeout": "TIMEOUT",
    "retry_cnt": "RETRY_CNT",
    "rnr_retry": "RNR_RETRY",
    "max_rd_atomic": "MAX_QP_RD_ATOMIC",
}


def connect_steps(
    local: RdmaPath,
    remote: RdmaPath,
    *,
    port: int,
    gid_index: int,
    access: int,
    rd_atomic: int = RD_ATOMIC,
) -> list[QpStep]:
    """INIT→RTR→RTS for an RC queue pair whose far end is ``remote``.

    The path MTU is the smaller of both ports' (RoCE ports follow their netdev's MTU and may
    differ); PSNs are each side's own random start.
    """
    init = QpStep(QpState.INIT, {"pkey_index": 0, "port_num": port, "qp_access_flags": access})
    rtr = QpStep(
        QpState.RTR,
        {
            "path_mtu": min(local.mtu, remote.mtu),
            "dest_qp_num": remote.qpn,
            "rq_psn": remote.psn,
            "max_dest_rd_atomic": rd_atomic,
            "min_rnr_timer": 12,
        },
        AddressVector(remote.gid, gid_index, port),
    )
    rts = QpStep(
        QpState.RTS,
        {
            "sq_psn": local.psn,
            "timeout": ACK_TIMEOUT,
            "retry_cnt": MAX_RETRY_CNT,
            "rnr_retry": RNR_RETRY,
            "max_rd_atomic": rd_atomic,
        },
    )
    return [init, rtr, rts]


class QpDriver:
    """Tracks one queue pair's state and refuses illegal transitions.

    A queue pair that reached ERR is never brought back: the transport destroys it and builds a
    new one (a QP recycled through RESET could still hold flushed work of the old connection).
    """

    def __init__(self, apply: Callable[[QpStep], None]) -> None:
        """``apply`` performs one step on the real queue pair (raises on failure)."""
        self._apply = apply
        self.state = QpState.RESET

    def connect(self, steps: Sequence[QpStep]) -> None:
        """Apply INIT→RTR→RTS; on failure the QP is put in ERR and BrokenError raised."""
        for step in steps:
            if self.state is QpState.ERR or _NEXT.get(self.state) is not step.state:
                raise BrokenError(f"illegal QP transition {self.state.value} → {step.state.value}")
            try:
                self._apply(step)
            except Exception as exc:
                self.fail()
                raise BrokenError(f"QP transition to {step.state.value} failed: {exc}") from exc
            self.state = step.state

    def fail(self) -> bool:
        """Move to ERR (flushes outstanding work); True if this call did it."""
        if self.state is QpState.ERR:
            return False
        self.state = QpState.ERR
        try:
            self._apply(QpStep(QpState.ERR))
        except Exception:  # already in error in hardware, or destroyed: flushed either way
            return True
        return True

    @property
    def usable(self) -> bool:
        """Ready to post work."""
        return self.state is QpState.RTS


def chunks(offset: int, length: int, limit: int) -> list[tuple[int, int]]:
    """(offset, length) pieces of at most ``limit`` bytes covering ``[offset, offset+length)``."""
    return [(offset + start, min(limit, length - start)) for start in range(0, length, limit)]


class Spreader:
    """Round-robin choice among paths, skipping the ones a caller excludes."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[int], exclude: frozenset[int] = frozenset()) -> int | None:
        """One of ``candidates`` not in ``exclude`` (next in turn), or None if none is left."""
        allowed = [c for c in candidates if c not in exclude]
        if not allowed:
            return None
        return allowed[next(self._counter) % len(allowed)]
