"""The transfer engine's section: defaults, validation, token handling."""

from __future__ import annotations

import pytest

from kvconnect.errors import ConfigError
from kvconnect.transfer import TransferConfig
from kvconnect.transfer.config import NativeMode, TransportName


def test_defaults_are_loopback_and_auto() -> None:
    config = TransferConfig()
    assert config.listen_host == "127.0.0.1"
    assert config.transport == "auto"
    assert config.metadata == "p2p"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"transport": "udp"}, "transport must be one of"),
        ({"tcp_streams": 0}, "tcp_streams must be > 0"),
        ({"tcp_streams": "two"}, "tcp_streams must be an integer"),
        ({"tcp_streams": True}, "must be a number"),
        ({"shm": "maybe"}, "shm must be a boolean"),
        ({"listen_port": 70000}, "listen_port"),
        ({"listen_host": "0.0.0.0"}, "advertise_host"),
        ({"slice_bytes": 1 << 30}, "slice_bytes must not exceed"),
        ({"max_frame_entries": 5000}, "iovec"),
        ({"name": 5}, "name must be a string"),
        ({"metadata": "zk://h:1"}, "metadata must be p2p, embedded or an etcd://"),
        ({"metadata": "etcd://h"}, "bad etcd endpoint"),
        ({"metadata_ttl": 0}, "metadata_ttl must be > 0"),
    ],
)
def test_invalid_values_are_rejected(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TransferConfig.from_mapping(data)


def test_metadata_accepts_etcd_urls() -> None:
    env = {"KVCONNECT_TRANSFER_METADATA": "etcd://10.0.0.1:2379,10.0.0.2:2379"}
    assert TransferConfig.from_env(env).metadata == env["KVCONNECT_TRANSFER_METADATA"]


def test_empty_token_is_an_error_but_an_empty_variable_means_unset() -> None:
    with pytest.raises(ConfigError, match="token"):
        TransferConfig(token="")
    assert TransferConfig.from_env({"KVCONNECT_TOKEN": ""}).token is None


def test_token_is_not_in_repr() -> None:
    assert "hunter2" not in repr(TransferConfig(token="hunter2"))


def test_choices_are_enum_members_however_they_are_given() -> None:
    env = TransferConfig.from_env({"KVCONNECT_TRANSFER_TRANSPORT": "tcp"})
    direct = TransferConfig(transport="tcp", native="off")  # type: ignore[arg-type]
    assert env.transport is TransportName.TCP
    assert direct.transport is TransportName.TCP
    assert direct.native is NativeMode.OFF
    with pytest.raises(ConfigError, match="native must be one of auto, on, off; got 'maybe'"):
        TransferConfig(native="maybe")  # type: ignore[arg-type]
