"""The ``--load-format kvconnect`` loader's fetch, without vLLM: its settings, the fetch into
the cache directory, the lock the workers of one host share, the fallback."""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvconnect.bench.etcd import EtcdServer, etcd_available
from kvconnect.errors import ConfigError, P2PError
from kvconnect.p2p import P2PConfig, P2PNode
from kvconnect.vllm.config import parse_loader_config
from kvconnect.vllm.loader import fetch_weights, safetensors_weights


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="JSON object"):
        parse_loader_config("name=x")
    with pytest.raises(ConfigError, match="needs 'name'"):
        parse_loader_config({})
    with pytest.raises(ConfigError, match="unknown"):
        parse_loader_config({"name": "m", "nmae": "x"})
    config = parse_loader_config(
        {"name": "m", "etcd": "etcd://10.0.0.5:2379", "p2p": {"parallel": 4}}
    )
    assert (config.p2p.etcd, config.p2p.parallel) == ("etcd://10.0.0.5:2379", 4)
    assert config.target() == Path.home() / ".cache" / "kvconnect" / "p2p" / "m"


def test_without_the_etcd_client_the_load_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pyetcd", None)  # an environment without kvconnect[p2p]
    settings = {"name": "m", "cache_dir": str(tmp_path), "timeout": 1.0}
    assert fetch_weights(parse_loader_config(settings)) is None
    with pytest.raises(ConfigError, match=r"kvconnect\[etcd\]"):
        fetch_weights(parse_loader_config({**settings, "fallback": False}))


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[tuple[EtcdServer, Path]]:
    if not etcd_available():
        pytest.skip("needs etcd")
    pytest.importorskip("pyetcd", reason="needs kvconnect[p2p] (vLLM 0.33's environment lacks it)")
    source = tmp_path / "source"
    source.mkdir()

    save_file({"a": np.arange(1000, dtype=np.float32)}, str(source / "model.safetensors"))
    (source / "config.json").write_text("{}")
    with EtcdServer() as etcd, P2PNode(P2PConfig.from_mapping({"etcd": etcd.url})) as node:
        node.publish(source, "m")
        yield etcd, source


def test_a_fetch_waits_for_the_workers_lock_and_falls_back_when_it_cannot(
    swarm: tuple[EtcdServer, Path], tmp_path: Path
) -> None:
    etcd, source = swarm
    target = tmp_path / "cache"
    target.mkdir()
    settings = {"etcd": etcd.url, "name": "m", "cache_dir": str(target), "seed": False}
    held = os.open(target / ".kvconnect-p2p.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # another worker of this host is fetching
        assert fetch_weights(parse_loader_config({**settings, "timeout": 0.3})) is None
        with pytest.raises(P2PError, match="locked"):
            fetch_weights(parse_loader_config({**settings, "timeout": 0.3, "fallback": False}))
    finally:
        os.close(held)
    assert fetch_weights(parse_loader_config(settings)) == target
    assert (target / "model.safetensors").read_bytes() == (
        source / "model.safetensors"
    ).read_bytes()
    [(name, tensor)] = list(safetensors_weights(target))
    assert name == "a"
    assert tensor.tolist() == list(range(1000))
