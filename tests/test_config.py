from __future__ import annotations

import dataclasses

import pytest

from kvconnect.config import TransferConfig
from kvconnect.errors import ConfigError


def test_defaults_are_loopback_and_auto() -> None:
    config = TransferConfig()
    assert config.listen_host == "127.0.0.1"
    assert config.transport == "auto"
    assert config.metadata == "p2p"


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TransferConfig().tcp_streams = 3  # type: ignore[misc]


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown TransferConfig key.*bogus.*valid:.*tcp_streams"
    ):
        TransferConfig.from_mapping({"bogus": 1})


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


def test_from_env_reads_prefixed_variables_and_shared_token() -> None:
    env = {
        "KVCONNECT_TRANSFER_TCP_STREAMS": "4",
        "KVCONNECT_TRANSFER_SHM": "false",
        "KVCONNECT_TRANSFER_IO_TIMEOUT": "2.5",
        "KVCONNECT_TOKEN": "secret",
        "UNRELATED": "x",
    }
    config = TransferConfig.from_env(env)
    assert (config.tcp_streams, config.shm, config.io_timeout, config.token) == (
        4,
        False,
        2.5,
        "secret",
    )


def test_from_env_overrides_win_and_unknown_variables_fail() -> None:
    assert (
        TransferConfig.from_env({"KVCONNECT_TRANSFER_TCP_STREAMS": "4"}, tcp_streams=1).tcp_streams
        == 1
    )
    with pytest.raises(ConfigError, match="KVCONNECT_TRANSFER_NOPE"):
        TransferConfig.from_env({"KVCONNECT_TRANSFER_NOPE": "1"})


def test_empty_token_is_an_error_but_an_empty_variable_means_unset() -> None:
    with pytest.raises(ConfigError, match="token"):
        TransferConfig(token="")
    assert TransferConfig.from_env({"KVCONNECT_TOKEN": ""}).token is None


def test_token_is_not_in_repr() -> None:
    assert "hunter2" not in repr(TransferConfig(token="hunter2"))
