"""The backend's configuration (no SGLang needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvconnect.errors import ConfigError
from kvconnect.sglang.config import HiCacheConfig, parse_config


def test_precedence_is_extra_config_then_file_then_environment(tmp_path: Path) -> None:
    settings = tmp_path / "kvconnect.json"
    settings.write_text(json.dumps({"read_timeout": 2.5, "namespace": "from-file"}))
    environ = {
        "KVCONNECT_SGLANG_CONFIG_FILE": str(settings),
        "KVCONNECT_SGLANG_NAMESPACE": "from-env",
        "KVCONNECT_SGLANG_WRITE_TIMEOUT": "7",
    }
    extra = {
        "master": "etcd://10.0.0.1:2379",
        "namespace": "inline",
        "backend_name": "kvconnect",  # SGLang's own keys are ignored
        "interface_v1": 1,
    }
    config = parse_config(extra, environ)
    assert config.store.master == "etcd://10.0.0.1:2379"
    assert config.namespace == "inline"
    assert config.read_timeout == 2.5
    assert config.write_timeout == 7.0
    assert parse_config(None, {}).store.master == "tcp://127.0.0.1:50051"


def test_bad_settings_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"read_timeot.*valid"):
        parse_config({"read_timeot": 1}, {})
    with pytest.raises(ConfigError, match="master"):
        parse_config({"master": "localhost:50051"}, {})
    with pytest.raises(ConfigError, match="KVCONNECT_SGLANG_MASTR"):
        parse_config({}, {"KVCONNECT_SGLANG_MASTR": "tcp://x:1"})
    with pytest.raises(ConfigError, match="cannot read"):
        parse_config({"config_file": str(tmp_path / "missing.json")}, {})
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        parse_config({"config_file": str(tmp_path / "list.json")}, {})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("file_storage_path", "/var/cache/sglang"),  # from --file-storage-path
        ("prefetch_threshold", 256),
        ("prefetch_timeout_base", 1.0),
        ("prefetch_timeout_per_ki_token", 0.25),
        ("hicache_storage_pass_prefix_keys", True),
        ("tp_lcm_size", 8),
        ("interface_v1", 1),
    ],
)
def test_sglang_own_keys_are_accepted_and_left_to_sglang(key: str, value: object) -> None:
    config = parse_config({"master": "tcp://10.0.0.1:50051", key: value}, {})
    assert config.store.master == "tcp://10.0.0.1:50051"
    assert not hasattr(config, key)


def test_unknown_keys_list_kvconnect_and_sglang_keys() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"prefetch_treshold": 64}, {})
    message = str(refused.value)
    assert "prefetch_treshold" in message
    assert "read_timeout" in message  # kvconnect's settings
    assert "prefetch_threshold" in message  # and SGLang's own


def test_store_and_transfer_sections_are_settable_from_the_extra_config() -> None:
    extra = {
        "rpc_timeout": 0.8,
        "store": {"replicas": 2},
        "transfer": {"tcp_streams": 3},
        "backend_name": "kvconnect",
    }
    config = parse_config(extra, {"KVCONNECT_TRANSFER_TRANSPORT": "tcp"})
    assert (config.store.replicas, config.store.rpc_timeout) == (2, 0.8)
    assert config.transfer.tcp_streams == 3
    assert config.transfer.transport == "auto", "the backend's transport wins over the variable"
    defaults = parse_config(None, {})
    assert defaults == HiCacheConfig()
    assert (defaults.store.rpc_timeout, defaults.store.breaker_cooldown) == (0.5, 2.0)


def test_unknown_nested_keys_are_refused_with_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown StoreClientConfig key.*replica;.*replicas"):
        parse_config({"store": {"replica": 2}}, {})
    with pytest.raises(ConfigError, match=r"set master or store\.master, not both"):
        parse_config({"master": "tcp://a:1", "store": {"master": "tcp://b:1"}}, {})
    with pytest.raises(ConfigError, match=r"read_timeout must be > 0"):
        parse_config({"read_timeout": 0}, {})
    assert parse_config({}, {}).read_timeout is None, "unset: the derived deadline alone"
