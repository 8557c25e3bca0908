"""The connector's settings (kvconnect/vllm/config.py, and the io_cpus CPU lists of
VllmConnectorConfig): pure, every environment."""

from __future__ import annotations

import pytest

from kvconnect.errors import ConfigError
from kvconnect.vllm.config import parse_config


def test_settings_from_extra_config_file_and_environment(tmp_path: object) -> None:
    config = parse_config({"lease": 5, "pool": True}, environ={"KVCONNECT_VLLM_LEASE": "7"})
    assert (config.lease, config.pool, config.read_timeout) == (5, True, 10.0)
    with pytest.raises(ConfigError, match="valid"):
        parse_config({"leese": 5}, environ={})
    with pytest.raises(ConfigError, match="master"):
        parse_config({"master": "http://x"}, environ={})


def test_cpu_lists_parse_and_bad_ones_are_config_errors() -> None:
    from kvconnect.config import VllmConnectorConfig, parse_cpu_list

    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    assert parse_cpu_list("") == frozenset()
    assert VllmConnectorConfig(io_cpus="2-3").io_cpu_set == {2, 3}
    for bad in ("3-1", "a", "-1", "1-x"):
        with pytest.raises(ConfigError, match="bad CPU list"):
            VllmConnectorConfig(io_cpus=bad)
