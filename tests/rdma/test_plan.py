"""Pure parts of the RDMA transport: QP transitions, the state machine, work-request planning,
routing and config."""

from __future__ import annotations

import pytest

from kvconnect.errors import BrokenError, ConfigError
from kvconnect.transfer import TransferConfig
from kvconnect.transfer.protocol.wire import RdmaPath
from kvconnect.transfer.transports.rdma.plan import (
    MAX_RETRY_CNT,
    AddressVector,
    QpDriver,
    QpState,
    QpStep,
    Spreader,
    chunks,
    connect_steps,
)

LOCAL = RdmaPath(0, "rxe0", "rxe1", b"\x01" * 16, 17, 1000, 5)  # MTU enum 5 = 4096
REMOTE = RdmaPath(0, "rxe1", "rxe0", b"\x02" * 16, 42, 2000, 3)  # 3 = 1024


def test_connect_steps_go_init_rtr_rts_with_the_peers_values() -> None:
    init, rtr, rts = connect_steps(LOCAL, REMOTE, port=1, gid_index=3, access=7, rd_atomic=8)
    assert [s.state for s in (init, rtr, rts)] == [QpState.INIT, QpState.RTR, QpState.RTS]
    assert init.fields == {"pkey_index": 0, "port_num": 1, "qp_access_flags": 7}
    assert init.mask == ("STATE", "PKEY_INDEX", "PORT", "ACCESS_FLAGS")
    assert rtr.fields["path_mtu"] == 3  # the smaller MTU of both ports
    assert rtr.fields["dest_qp_num"] == 42
    assert rtr.fields["rq_psn"] == 2000  # the peer's send PSN
    assert rtr.fields["max_dest_rd_atomic"] == 8
    assert rtr.av == AddressVector(REMOTE.gid, 3, 1)  # global route: RoCE needs a GRH
    assert rtr.mask[-1] == "AV"
    assert rts.fields["sq_psn"] == 1000
    assert rts.fields["retry_cnt"] == MAX_RETRY_CNT <= 6  # 7 would retry forever
    assert rts.fields["max_rd_atomic"] == 8
    assert set(rts.mask) == {
        "STATE",
        "SQ_PSN",
        "TIMEOUT",
        "RETRY_CNT",
        "RNR_RETRY",
        "MAX_QP_RD_ATOMIC",
    }


def test_driver_applies_steps_in_order_and_never_leaves_err() -> None:
    applied: list[QpState] = []
    driver = QpDriver(lambda step: applied.append(step.state))
    steps = connect_steps(LOCAL, REMOTE, port=1, gid_index=1, access=7)
    driver.connect(steps)
    assert applied == [QpState.INIT, QpState.RTR, QpState.RTS]
    assert driver.usable
    assert driver.fail() is True
    assert driver.fail() is False  # once in ERR, it stays there: only a new QP is used again
    assert applied[-1] is QpState.ERR
    assert not driver.usable
    with pytest.raises(BrokenError, match="illegal QP transition err"):
        driver.connect(steps)


def test_driver_refuses_skipped_states_and_fails_the_qp_on_a_verbs_error() -> None:
    driver = QpDriver(lambda step: None)
    init, rtr, rts = connect_steps(LOCAL, REMOTE, port=1, gid_index=1, access=7)
    with pytest.raises(BrokenError, match="reset → rtr"):
        driver.connect([rtr, rts])

    applied: list[QpState] = []

    def apply(step: QpStep) -> None:
        applied.append(step.state)
        if step.state is QpState.RTR:
            raise OSError("EINVAL")

    failing = QpDriver(apply)
    with pytest.raises(BrokenError, match="to rtr failed: EINVAL"):
        failing.connect([init, rtr, rts])
    assert failing.state is QpState.ERR
    assert applied == [QpState.INIT, QpState.RTR, QpState.ERR]


@pytest.mark.parametrize(
    ("offset", "length", "limit", "expected"),
    [
        (0, 1, 4096, [(0, 1)]),
        (3, 10, 4, [(3, 4), (7, 4), (11, 2)]),
        (5, 8, 4, [(5, 4), (9, 4)]),
    ],
)
def test_chunks_cover_the_range_exactly(
    offset: int, length: int, limit: int, expected: list[tuple[int, int]]
) -> None:
    pieces = chunks(offset, length, limit)
    assert pieces == expected
    assert sum(n for _, n in pieces) == length


def test_spreader_round_robins_and_skips_excluded_paths() -> None:
    spreader = Spreader()
    assert [spreader.pick([0, 1, 2]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    picks = {spreader.pick([0, 1, 2], frozenset({1})) for _ in range(4)}
    assert picks == {0, 2}
    assert spreader.pick([0, 1], frozenset({0, 1})) is None


def test_rdma_config_is_validated() -> None:
    config = TransferConfig.from_env(
        {"KVCONNECT_TRANSFER_RDMA_NICS": "mlx5_0,mlx5_1", "KVCONNECT_TRANSFER_RDMA_GID_INDEX": "3"}
    )
    assert config.rdma_nics == "mlx5_0,mlx5_1"
    assert config.rdma_gid_index == 3
    with pytest.raises(ConfigError, match="rdma_qps_per_peer"):
        TransferConfig(rdma_qps_per_peer=0)
    with pytest.raises(ConfigError, match="rdma_inline_bytes"):
        TransferConfig(rdma_inline_bytes=-1)
    with pytest.raises(ConfigError, match="transport must be one of"):
        TransferConfig.from_mapping({"transport": "verbs"})
