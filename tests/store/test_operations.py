"""Operating the store: metrics, configuration files, the all-in-one demo, multi-part puts."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvconnect.cli import build_parser, section_config
from kvconnect.errors import ConfigError
from kvconnect.store.client import StoreClient
from kvconnect.store.config import MasterConfig, StoreClientConfig, StoreServerConfig
from kvconnect.store.launch import Cluster, free_port
from kvconnect.store.messages import Code
from kvconnect.testing.peer import pattern
from kvconnect.transfer import TransferConfig
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
MiB = 1 << 20


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text: str = response.read().decode()
    return text


def test_prometheus_metrics_of_master_and_store_server() -> None:
    master_port, store_port = free_port(), free_port()
    with Cluster(
        servers=1,
        server_size=16 * MiB,
        master_args=["--master-metrics-port", str(master_port)],
        server_args=["--store-metrics-port", str(store_port)],
    ) as cluster:
        over_tcp = TransferConfig(transport="tcp")  # shared memory would bypass the server
        with StoreClient(StoreClientConfig(master=cluster.master_endpoint), over_tcp) as client:
            assert client.put("metered", b"x" * 4096) is Code.OK
            assert client.get("metered") == b"x" * 4096
        # the master refreshes its snapshot every second
        wait_for(lambda: "kvconnect_master_keys 1.0" in _scrape(master_port), "keys not exported")
        master = _scrape(master_port)
        assert 'kvconnect_segment_capacity_bytes{segment="' in master
        assert 'kvconnect_master_rpc_seconds_count{method="PutStart"} 1.0' in master
        store = _scrape(store_port)
        assert "kvconnect_store_capacity_bytes" in store
        served = [
            line for line in store.splitlines() if line.startswith("kvconnect_store_served_bytes")
        ]
        assert served
        assert float(served[0].split()[-1]) >= 4096
        count = [
            line
            for line in store.splitlines()
            if line.startswith("kvconnect_store_transfer_seconds_count")
        ]
        assert float(count[0].split()[-1]) >= 2, "the put and the get were each a frame"


def test_config_file_then_environment_then_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kvconnect.json"
    config.write_text(
        json.dumps({"master": {"lease_ttl": 3, "put_timeout": 7}, "store": {"size": "2G"}})
    )
    monkeypatch.setenv("KVCONNECT_MASTER_PUT_TIMEOUT", "8")
    args = build_parser().parse_args(
        ["serve", "--config", str(config), "--master-high-watermark", "0.9"]
    )
    master = section_config(args, "master", MasterConfig)
    assert (master.lease_ttl, master.put_timeout, master.high_watermark) == (3.0, 8.0, 0.9)
    assert section_config(args, "store", StoreServerConfig).size == 2 << 30
    config.write_text(json.dumps({"masters": {}}))
    with pytest.raises(ConfigError, match="unknown section"):
        section_config(args, "master", MasterConfig)
    config.write_text(json.dumps({"master": {"lease": 1}}))
    with pytest.raises(ConfigError, match="unknown MasterConfig key"):
        section_config(args, "master", MasterConfig)


def test_bad_configuration_exits_with_a_clear_message() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvconnect.cli", "master", "--master-high-watermark", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "high_watermark must be in (0, 1]" in out.stderr


def test_multi_part_object_is_readable_only_when_every_writer_is_done() -> None:
    with Cluster(servers=1, server_size=16 * MiB) as cluster:
        config = StoreClientConfig(master=cluster.master_endpoint)
        with (
            StoreClient(config) as rank0,
            StoreClient(config) as rank1,
            StoreClient(config) as reader,
        ):
            whole = pattern(5, 2 * MiB)
            shards = [rank0.register(whole[:MiB].copy()), rank1.register(whole[MiB:].copy())]
            keys = ["page-0"]
            first = rank0.batch_put_part_from(
                keys,
                shards[0],
                [0],
                [MiB],
                part=0,
                parts=2,
                object_sizes=[2 * MiB],
                object_offsets=[0],
            )
            assert first.codes == (Code.OK,)
            assert reader.batch_exists(keys) == [False], "half an object must not be readable"
            second = rank1.batch_put_part_from(
                keys,
                shards[1],
                [0],
                [MiB],
                part=1,
                parts=2,
                object_sizes=[2 * MiB],
                object_offsets=[MiB],
            )
            assert second.codes == (Code.OK,)
            assert reader.get("page-0") == whole.tobytes()
            target = reader.register(np.zeros(2 * MiB, dtype=np.uint8))
            assert reader.batch_get_into(keys, target, [0], [2 * MiB]).sizes == (2 * MiB,)


@pytest.mark.slow
def test_demo_runs_and_verifies_every_page(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvconnect.cli",
            "demo",
            "--seconds",
            "3",
            "--clients",
            "2",
            "--store-mib",
            "128",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    total = next(line for line in out.stdout.splitlines() if line.strip().startswith("all"))
    requests, hit_rate, corrupt = total.split()[1], total.split()[2], total.split()[-1]
    assert int(requests) > 0
    assert float(hit_rate.rstrip("%")) > 50  # pages are shared between the clients
    assert corrupt == "0"


@pytest.mark.slow
def test_bench_store_smoke(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kvconnect.cli",
            "bench",
            "store",
            "--quick",
            "--modes",
            "tcp",
            "--scale",
            "2000,3000",
            "--poll-ab",
            "--out",
            "store.json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        check=True,
    )
    report = json.loads((tmp_path / "store.json").read_text())
    ops = {row["op"] for row in report["data"]["tcp"]}
    assert ops == {"put", "get", "batch_put_from", "batch_get_into", "exists", "batch_exists"}
    for row in report["data"]["tcp"]:  # polling, and every poll window 0, side by side
        for system in ("kvconnect", "kvconnect-sleeping"):
            assert row[system]["p50_ms"] > 0
            assert row[system]["cpu_us"] > 0  # this process's and the store's CPU per call
    assert [row["objects"] for row in report["scale"]] == [2000, 3000]
    for row in report["scale"]:
        scaled = row["kvconnect"]
        assert 0 < scaled["bytes_per_object"] < 5000
        # timed beside the master kept at the first count: the growth is their ratio
        assert scaled["growth"] == pytest.approx(scaled["p50_us"] / scaled["reference_p50_us"])
    assert report["eviction"]["evicting"]["evictions"] > 0
    assert report["eviction"]["no_eviction"]["evictions"] == 0
