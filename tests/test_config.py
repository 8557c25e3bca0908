"""The configuration machinery (kvconnect._config), shown on the transfer section and on an
engine-like section that embeds the store-client and transfer sections."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import pytest

from kvconnect._config import Composed, Route, embedded_default, layered, parse_size
from kvconnect.errors import ConfigError
from kvconnect.store.config import StoreClientConfig
from kvconnect.transfer import TransferConfig


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TransferConfig().tcp_streams = 3  # type: ignore[misc]


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown TransferConfig key.*bogus.*valid:.*tcp_streams"
    ):
        TransferConfig.from_mapping({"bogus": 1})


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


_ROUTES = {
    "master": Route("store", "master", "tcp://engine:1"),
    "streams": Route("transfer", "tcp_streams", 3),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Engine(Composed):
    _ENV_PREFIX: ClassVar[str] = "KVCONNECT_ENGINE_"
    _ROUTES: ClassVar[Mapping[str, Route]] = _ROUTES

    store: StoreClientConfig = dataclasses.field(
        default_factory=embedded_default(StoreClientConfig, _ROUTES, "store")
    )
    transfer: TransferConfig = dataclasses.field(
        default_factory=embedded_default(TransferConfig, _ROUTES, "transfer")
    )
    config_file: str = ""
    lease: float = 1.0


def test_an_embedding_section_routes_flat_keys_and_takes_nested_ones() -> None:
    assert _Engine.from_mapping({}) == _Engine()
    assert (_Engine().store.master, _Engine().transfer.tcp_streams) == ("tcp://engine:1", 3)
    config = _Engine.from_mapping({"streams": 5, "store": {"replicas": 2}, "lease": 2})
    assert (config.transfer.tcp_streams, config.store.replicas, config.lease) == (5, 2, 2.0)
    assert _Engine.valid_keys() == {"store", "transfer", "config_file", "lease"} | set(_ROUTES)
    assert _Engine.env_keys() == {"config_file", "lease", "master", "streams"}


def test_layers_merge_field_by_field_over_the_sections_own_variables(tmp_path: Path) -> None:
    settings = tmp_path / "engine.json"
    settings.write_text(json.dumps({"store": {"replicas": 2, "io_timeout": 3}, "lease": 4}))
    environ = {
        "KVCONNECT_ENGINE_CONFIG_FILE": str(settings),
        "KVCONNECT_ENGINE_MASTER": "tcp://env:1",
        "KVCONNECT_CLIENT_NEGATIVE_TTL": "7",
        "KVCONNECT_CLIENT_MASTER": "tcp://ignored:1",  # below the engine's default
        "KVCONNECT_TRANSFER_SHM": "false",
    }
    config = layered(_Engine, {"store": {"replicas": 3}}, environ)
    assert (config.store.replicas, config.store.io_timeout, config.lease) == (3, 3.0, 4.0)
    assert (config.store.master, config.store.negative_ttl) == ("tcp://env:1", 7.0)
    assert (config.transfer.shm, config.transfer.tcp_streams) == (False, 3)


def test_an_embedding_section_refuses_what_it_cannot_place() -> None:
    with pytest.raises(ConfigError, match=r"unknown _Engine key\(s\) bogus; valid: config_file"):
        _Engine.from_mapping({"bogus": 1})
    with pytest.raises(ConfigError, match=r"section 'store': unknown StoreClientConfig key"):
        _Engine.from_mapping({"store": {"bogus": 1}})
    with pytest.raises(ConfigError, match=r"set streams or transfer\.tcp_streams, not both"):
        _Engine.from_mapping({"streams": 1, "transfer": {"tcp_streams": 2}})
    with pytest.raises(ConfigError, match="transfer must be a mapping of TransferConfig keys"):
        _Engine.from_mapping({"transfer": "tcp"})
    with pytest.raises(ConfigError, match=r"\(streams sets tcp_streams\): tcp_streams must be > 0"):
        _Engine.from_mapping({"streams": 0})
    with pytest.raises(ConfigError, match="unknown environment variable KVCONNECT_ENGINE_STORE"):
        _Engine.from_layers(environ={"KVCONNECT_ENGINE_STORE": "{}"})


@pytest.mark.parametrize(
    ("text", "size"), [("64K", 65536), ("2g", 2 << 30), (" 512M ", 512 << 20), ("100", 100)]
)
def test_sizes_parse_with_binary_suffixes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "M", "1.5G", "ten", "4Q"])
def test_a_malformed_size_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="size must be an integer"):
        parse_size(text)
