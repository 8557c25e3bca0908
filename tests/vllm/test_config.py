"""The connector's settings (kvconnect/vllm/config.py: the embedded store and transfer sections,
the io_cpus CPU lists): pure, every environment."""

from __future__ import annotations

import pytest

from kvconnect.errors import ConfigError
from kvconnect.vllm.config import VllmConnectorConfig, parse_config, parse_cpu_list


def test_settings_from_extra_config_file_and_environment(tmp_path: object) -> None:
    config = parse_config({"lease": 5, "pool": True}, environ={"KVCONNECT_VLLM_LEASE": "7"})
    assert (config.lease, config.pool, config.read_timeout) == (5, True, 10.0)
    with pytest.raises(ConfigError, match="valid"):
        parse_config({"leese": 5}, environ={})
    with pytest.raises(ConfigError, match="master"):
        parse_config({"master": "http://x"}, environ={})


def test_flat_keys_route_to_the_embedded_store_and_transfer_sections() -> None:
    config = parse_config(
        {"host": "10.0.0.5", "transport": "tcp", "master": "tcp://m:1", "pool_rpc_timeout": 0.7},
        environ={"KVCONNECT_VLLM_CONNECT_TIMEOUT": "4"},
    )
    assert (config.host, config.transfer.listen_host) == ("10.0.0.5", "10.0.0.5")
    assert (config.transfer.transport, config.transfer.connect_timeout) == ("tcp", 4.0)
    assert (config.store.master, config.store.rpc_timeout) == ("tcp://m:1", 0.7)
    defaults = parse_config(None, environ={})
    assert defaults == VllmConnectorConfig()
    assert (defaults.transfer.connect_timeout, defaults.store.rpc_timeout) == (2.0, 0.5)


def test_every_store_and_transfer_field_is_settable_through_the_nested_sections() -> None:
    extra = {"store": {"replicas": 3}, "transfer": {"tcp_streams": 4}}
    config = parse_config(extra, environ={"KVCONNECT_TRANSFER_IO_TIMEOUT": "2.5"})
    assert config.store.replicas == 3
    assert (config.transfer.tcp_streams, config.transfer.io_timeout) == (4, 2.5)
    env = {"KVCONNECT_CLIENT_REPLICAS": "2", "KVCONNECT_TRANSFER_CONNECT_TIMEOUT": "9"}
    config = parse_config({}, environ=env)
    assert config.store.replicas == 2, "the section's own variables, below everything else"
    assert config.transfer.connect_timeout == 2.0, "the connector's default wins over them"


def test_unknown_nested_keys_and_double_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown StoreClientConfig key.*replica;.*replicas"):
        parse_config({"store": {"replica": 2}}, environ={})
    with pytest.raises(ConfigError, match=r"unknown TransferConfig key.*streams;.*tcp_streams"):
        parse_config({"transfer": {"streams": 2}}, environ={})
    with pytest.raises(ConfigError, match=r"valid:.*pool_rpc_timeout.*store.*transfer"):
        parse_config({"stores": {}}, environ={})
    with pytest.raises(ConfigError, match=r"set host or transfer\.listen_host, not both"):
        parse_config({"host": "a", "transfer": {"listen_host": "b"}}, environ={})
    with pytest.raises(ConfigError, match="store must be a mapping"):
        parse_config({"store": 2}, environ={})
    with pytest.raises(ConfigError, match=r"pool_rpc_timeout sets rpc_timeout.*must be > 0"):
        parse_config({"pool_rpc_timeout": 0}, environ={})
    with pytest.raises(ConfigError, match="KVCONNECT_VLLM_STORE;"):
        parse_config({}, environ={"KVCONNECT_VLLM_STORE": "{}"})


def test_cpu_lists_parse_and_bad_ones_are_config_errors() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    assert parse_cpu_list("") == frozenset()
    assert VllmConnectorConfig(io_cpus="2-3").io_cpu_set == {2, 3}
    for bad in ("3-1", "a", "-1", "1-x"):
        with pytest.raises(ConfigError, match="bad CPU list"):
            VllmConnectorConfig(io_cpus=bad)


def test_the_gil_switch_interval_is_bounded() -> None:
    assert VllmConnectorConfig().gil_switch_interval == 0.0002
    assert VllmConnectorConfig(gil_switch_interval=0).gil_switch_interval == 0
    for bad in (-0.001, 0.01):
        with pytest.raises(ConfigError, match="gil_switch_interval"):
            VllmConnectorConfig(gil_switch_interval=bad)
