"""The P2P store across processes in network namespaces behind rate-limited links (tbf), as
``kvconnect p2p`` runs them: a swarm filling peers, a holder killed mid-transfer, etcd
restarted mid-fetch, a fetch killed and resumed. Needs root, iproute2, tc and etcd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconnect.bench.etcd import EtcdServer, etcd_available
from kvconnect.bench.netns import Node, Star, unavailable
from kvconnect.etcd import Etcd
from kvconnect.p2p.manifest import Manifest
from kvconnect.p2p.registry import Registry
from kvconnect.store.launch import Process
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
    pytest.mark.skipif(not etcd_available(), reason="needs etcd"),
]

MiB = 1 << 20
RATE_MBIT = 40  # 5 MB/s: a 16 MiB object takes seconds, long enough to act during it
SIZES = {"model-1.safetensors": 10 * MiB + 12345, "model-2.safetensors": 6 * MiB}
CHUNKS = sum(-(-size // MiB) for size in SIZES.values())
PREFIX = "/kvconnect/p2p/"


@pytest.fixture(scope="module")
def star() -> Iterator[Star]:
    with Star(4, RATE_MBIT, tag="t") as topology:
        yield topology


@pytest.fixture
def etcd(star: Star) -> Iterator[EtcdServer]:
    with EtcdServer(host=star.nodes[0].gateway) as server:
        yield server


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("checkpoint")
    for name, size in SIZES.items():
        (root / name).write_bytes(os.urandom(size))
    return root


def _options(node: Node, etcd: EtcdServer) -> list[str]:
    return ["--etcd", etcd.url, "--listen-host", node.address, "--chunk-bytes", str(MiB)]


def _publish(node: Node, etcd: EtcdServer, source: Path, name: str) -> tuple[Process, dict]:
    args = ["p2p", "publish", str(source), "--name", name, "--json", *_options(node, etcd)]
    publisher = Process(args, '"version"', timeout=120, netns=node.netns)
    return publisher, json.loads(publisher.banner)


def _fetch(
    node: Node, etcd: EtcdServer, name: str, target: Path, *extra: str
) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "kvconnect.cli", "p2p", "fetch", name, str(target), "--json"]
    return subprocess.Popen(
        node.command([*args, "--timeout", "120", *_options(node, etcd), *extra]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _report(proc: subprocess.Popen[str]) -> dict:
    """The JSON line of a fetch without --seed (it exits after it)."""
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _first_line(proc: subprocess.Popen[str]) -> dict:
    """The JSON line of a fetch with --seed (it keeps serving)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the fetch ended: {proc.communicate(timeout=10)[1][-3000:]}"
    return json.loads(line)


def _stop(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
        proc.communicate(timeout=30)


def _same(source: Path, target: Path) -> None:
    for name in SIZES:
        assert (source / name).read_bytes() == (target / name).read_bytes(), name


def _stored_by(etcd: EtcdServer, name: str, node: Node) -> int:
    """Chunks the holder at ``node`` announced as stored (0 before its record exists)."""
    client = Etcd(etcd.url)
    try:
        registry = Registry(client, PREFIX)
        manifest: Manifest = registry.manifest(name)
        records, _ = registry.holders(manifest)
        return max(
            (int(r.bits(manifest.chunk_count)[0].sum()) for r in records.values()
             if r.segment.startswith(node.address + ":")),
            default=0,
        )  # fmt: skip
    finally:
        client.close()


def test_peers_fill_each_other_byte_for_byte(
    star: Star, etcd: EtcdServer, source: Path, tmp_path: Path
) -> None:
    publisher, published = _publish(star.nodes[0], etcd, source, "swarm")
    peers = star.nodes[1:]
    procs = [_fetch(n, etcd, "swarm", tmp_path / n.netns, "--seed") for n in peers]
    try:
        reports = [_first_line(p) for p in procs]
    finally:
        _stop(*procs)
        publisher.stop()
    for node in peers:
        _same(source, tmp_path / node.netns)
    total = sum(SIZES.values())
    assert all(r["fetched_bytes"] == total for r in reports)
    # Peers served each other: the publisher sent fewer than one copy per peer (it sends
    # exactly one per peer when peers do not share).
    from_publisher = sum(r["by_holder"].get(published["segment"], 0) for r in reports)
    assert from_publisher < (len(peers) - 1) * total
    assert sum(sum(r["by_holder"].values()) for r in reports) == len(peers) * total


def test_a_holder_killed_mid_transfer(
    star: Star, etcd: EtcdServer, source: Path, tmp_path: Path
) -> None:
    publisher, _ = _publish(star.nodes[0], etcd, source, "kill")
    seeder = _fetch(star.nodes[1], etcd, "kill", tmp_path / "seeder", "--seed")
    try:
        _first_line(seeder)
        late = _fetch(star.nodes[2], etcd, "kill", tmp_path / "late")
        wait_for(lambda: _stored_by(etcd, "kill", star.nodes[2]) >= 3, "no chunk arrived", 60)
        seeder.kill()  # SIGKILL: its transfers break, its lease ends by itself
        report = _report(late)
    finally:
        _stop(seeder)
        publisher.stop()
    _same(source, tmp_path / "late")
    assert report["fetched_bytes"] == sum(SIZES.values())
    wait_for(lambda: _stored_by(etcd, "kill", star.nodes[1]) == 0, "the dead holder stayed", 30)


def test_etcd_restarts_mid_fetch(
    star: Star, etcd: EtcdServer, source: Path, tmp_path: Path
) -> None:
    publisher, _ = _publish(star.nodes[0], etcd, source, "restart")
    fetcher = _fetch(star.nodes[1], etcd, "restart", tmp_path / "f", "--seed")
    try:
        wait_for(lambda: _stored_by(etcd, "restart", star.nodes[1]) >= 2, "no chunk arrived", 60)
        etcd.kill()
        etcd.start()
        report = _first_line(fetcher)
        # Announcements went on after the restart: the whole copy is announced.
        wait_for(
            lambda: _stored_by(etcd, "restart", star.nodes[1]) == CHUNKS, "not announced after", 30
        )
    finally:
        _stop(fetcher)
        publisher.stop()
    _same(source, tmp_path / "f")
    assert report["fetched_bytes"] == sum(SIZES.values())


def test_a_killed_fetch_resumes_without_fetching_again(
    star: Star, etcd: EtcdServer, source: Path, tmp_path: Path
) -> None:
    publisher, _ = _publish(star.nodes[0], etcd, source, "resume")
    target = tmp_path / "resumed"
    try:
        first = _fetch(star.nodes[3], etcd, "resume", target)
        wait_for(lambda: _stored_by(etcd, "resume", star.nodes[3]) >= 4, "no chunk arrived", 60)
        first.kill()
        first.communicate(timeout=30)
        report = _report(_fetch(star.nodes[3], etcd, "resume", target))
    finally:
        publisher.stop()
    _same(source, target)
    assert report["reused_chunks"] >= 4
    assert report["fetched_chunks"] == CHUNKS - report["reused_chunks"]
