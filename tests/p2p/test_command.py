"""``kvconnect p2p`` as users run it (child processes on loopback, a real etcd): publish,
fetch with a JSON report, ls, rm, and errors stated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconnect.bench.etcd import EtcdServer, etcd_available
from kvconnect.store.launch import Process

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not etcd_available(), reason="needs etcd"),
]


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


def _p2p(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvconnect.cli", "p2p", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_publish_fetch_ls_rm(etcd: EtcdServer, tmp_path: Path) -> None:
    source = tmp_path / "model"
    (source / "shards").mkdir(parents=True)
    (source / "config.json").write_text('{"hidden": 8}')
    (source / "shards" / "w.safetensors").write_bytes(os.urandom(3 * 4096 + 5))
    url = ["--etcd", etcd.url]
    publisher = Process(
        ["p2p", "publish", str(source), "--name", "m", "--version", "v1", "--json", *url],
        '"version"',
    )
    try:
        published = json.loads(publisher.banner)
        assert (published["name"], published["version"], published["files"]) == ("m", "v1", 2)
        done = _p2p("fetch", "m", str(tmp_path / "out"), "--json", *url)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["fetched_bytes"] == report["bytes"] == 3 * 4096 + 5 + 13
        assert set(report["by_holder"]) == {published["segment"]}
        for name in ("config.json", "shards/w.safetensors"):
            assert (tmp_path / "out" / name).read_bytes() == (source / name).read_bytes()
        listing = json.loads(_p2p("ls", "--json", *url).stdout)
        assert [(r["name"], r["version"], r["complete_holders"]) for r in listing] == [
            ("m", "v1", 1)
        ]
        assert json.loads(_p2p("rm", "m", "--json", *url).stdout)["removed"]
        assert json.loads(_p2p("ls", "--json", *url).stdout) == []
        gone = _p2p("fetch", "m", str(tmp_path / "again"), *url)
        assert gone.returncode == 1
        assert "nothing is published under 'm'" in gone.stderr
    finally:
        publisher.stop()


def test_bad_settings_are_refused_with_the_reason(tmp_path: Path) -> None:
    done = _p2p("ls", "--etcd", "http://nowhere")
    assert done.returncode == 1
    assert "not an etcd URL" in done.stderr
    done = _p2p("publish", str(tmp_path), "--name", "../x", "--etcd", "etcd://127.0.0.1:9")
    assert done.returncode == 1
    assert "name must be" in done.stderr
