"""The backend's pure parts: page keys and configuration (no SGLang needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvconnect.errors import ConfigError
from kvconnect.sglang.config import parse_config
from kvconnect.sglang.keys import PageFormat, page_keys


def _fmt(**changes: object) -> PageFormat:
    base: dict[str, object] = {
        "model": "Qwen/Qwen3-8B",
        "layout": "page_first",
        "dtype": "bfloat16",
        "page_size": 64,
        "mla": False,
    }
    return PageFormat(**{**base, **changes})  # type: ignore[arg-type]


def test_mha_pages_are_two_objects_per_rank_and_mla_pages_one_shared() -> None:
    rank0 = page_keys(_fmt(tp_rank=0, tp_size=2)).keys(["h1", "h2"])
    rank1 = page_keys(_fmt(tp_rank=1, tp_size=2)).keys(["h1", "h2"])
    assert len(rank0) == 4
    assert rank0[0].endswith("/k")
    assert rank0[1].endswith("/v")
    assert not set(rank0) & set(rank1), "MHA ranks hold different heads: separate keys"
    mla0 = page_keys(_fmt(mla=True, tp_rank=0, tp_size=2)).keys(["h1"])
    mla1 = page_keys(_fmt(mla=True, tp_rank=1, tp_size=2)).keys(["h1"])
    assert mla0 == mla1, "MLA pages are the same on every rank"
    assert len(mla0) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"layout": "page_first_direct"},
        {"dtype": "float16"},
        {"page_size": 32},
        {"model": "other"},
        {"tp_size": 4},
        {"namespace": "tenant-b"},
        {"pp_rank": 1, "pp_size": 2},
        {"dcp_rank": 1, "dcp_size": 2},
    ],
)
def test_anything_that_changes_the_bytes_changes_the_key(change: dict[str, object]) -> None:
    assert page_keys(_fmt()).keys(["h"]) != page_keys(_fmt(**change)).keys(["h"])


def test_leading_pages_needs_every_object_of_a_page() -> None:
    mha = page_keys(_fmt())
    assert mha.leading_pages([True, True, True, False, True, True]) == 1
    assert mha.leading_pages([True, True] * 3) == 3
    assert mha.leading_pages([False, True]) == 0
    assert page_keys(_fmt(mla=True)).leading_pages([True, True, False]) == 2


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
    assert config.master == "etcd://10.0.0.1:2379"
    assert config.namespace == "inline"
    assert config.read_timeout == 2.5
    assert config.write_timeout == 7.0
    assert parse_config(None, {}).master == "tcp://127.0.0.1:50051"


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
    assert config.master == "tcp://10.0.0.1:50051"
    assert not hasattr(config, key)


def test_unknown_keys_list_kvconnect_and_sglang_keys() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"prefetch_treshold": 64}, {})
    message = str(refused.value)
    assert "prefetch_treshold" in message
    assert "read_timeout" in message  # kvconnect's settings
    assert "prefetch_threshold" in message  # and SGLang's own
