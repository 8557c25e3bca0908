"""P2P nodes against a real etcd, in this process: publish, fetch into files and memory,
resume, conflicts, hostile records, wrong tokens, corrupt holders, a publisher that left."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvconnect.bench.etcd import EtcdServer, etcd_available
from kvconnect.errors import ConfigError, P2PError, ProtocolError, TransferError
from kvconnect.etcd import Etcd
from kvconnect.p2p import Buffers, Files, Manifest, P2PConfig, P2PNode, Proximity
from kvconnect.p2p import manifest as m
from kvconnect.p2p.manifest import chunks_of
from kvconnect.transfer import TransferConfig, TransferEngine
from tests.support.leaks import wait_no_kvconnect_threads
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not etcd_available(), reason="needs etcd"),
]

CHUNK = 4096
FILES = {
    "model-1.safetensors": 9 * CHUNK + 123,
    "sub/model-2.safetensors": 5 * CHUNK,
    "config.json": 77,
    "empty.txt": 0,
}


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "source"
    for name, size in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(os.urandom(size))
    return root


def config(etcd: EtcdServer, **changes: object) -> P2PConfig:
    return P2PConfig.from_mapping(
        {"etcd": etcd.url, "chunk_bytes": CHUNK, "stall_timeout": 3.0, **changes}
    )


def same_files(a: Path, b: Path) -> None:
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_fetch_into_files_and_memory_byte_for_byte(
    etcd: EtcdServer, source: Path, tmp_path: Path
) -> None:
    with P2PNode(config(etcd)) as publisher, P2PNode(config(etcd)) as a, P2PNode(config(etcd)) as b:
        manifest = publisher.publish(source, "model")
        got, stats = a.fetch("model", Files(tmp_path / "a"))
        assert got == manifest
        same_files(source, tmp_path / "a")
        assert stats.fetched == manifest.chunk_count
        assert stats.reused == 0
        assert stats.fetched_bytes == sum(FILES.values())
        assert stats.by_proximity == {Proximity.HOST: sum(FILES.values())}
        with pytest.raises(P2PError, match="elsewhere"):
            a.fetch("model", Files(tmp_path / "again"))  # a node holds an object in one place
        buffers = {name: bytearray(size) for name, size in FILES.items() if size}
        _, stats = b.fetch("model", Buffers(buffers), manifest.version)
        for name, buffer in buffers.items():
            assert bytes(buffer) == (source / name).read_bytes()
        assert set(stats.by_holder) <= {publisher.segment, a.segment}
        # Each holder announces what it stored (within announce_interval): three full copies.
        wait_for(lambda: [x.complete for x in publisher.listing()] == [3], "not announced")


def test_a_fetch_resumes_keeping_verified_chunks(
    etcd: EtcdServer, source: Path, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    first = (source / "model-1.safetensors").read_bytes()
    partial = bytearray(first[: 6 * CHUNK])
    partial[CHUNK + 5] ^= 0xFF  # chunk 1 is damaged: fetched again
    (target / "model-1.safetensors").write_bytes(partial)  # chunks 0, 2-5 are good
    with P2PNode(config(etcd)) as publisher, P2PNode(config(etcd)) as node:
        manifest = publisher.publish(source, "model")
        _, stats = node.fetch("model", Files(target))
    same_files(source, target)
    assert stats.reused == 5
    assert stats.fetched == manifest.chunk_count - 5


def test_a_published_version_names_one_content(etcd: EtcdServer, source: Path) -> None:
    with P2PNode(config(etcd)) as node:
        node.publish(source, "model", "v1")
        node.publish(source, "model", "v1")  # the same content again: a no-op
        (source / "config.json").write_bytes(b"{}")
        with pytest.raises(P2PError, match="another content"):
            node.publish(source, "model", "v1")
        with pytest.raises(P2PError, match="nothing is published"):
            node.registry.manifest("other")
        with pytest.raises(P2PError, match="no version"):
            node.registry.manifest("model", "v9")


def test_hostile_records_are_ignored_and_hostile_manifests_refused(
    etcd: EtcdServer, source: Path, tmp_path: Path
) -> None:
    with P2PNode(config(etcd)) as publisher, P2PNode(config(etcd)) as node:
        manifest = publisher.publish(source, "model")
        client = Etcd(etcd.url)
        try:
            holders = publisher.registry.holders_prefix("model", manifest.version)
            client.put(holders + "garbage", b"\xc1\x00")
            client.put(holders + "short", msgspec.msgpack.encode({"schema": 1}))
            evil = Manifest(
                m.SCHEMA, "evil", "v1", CHUNK, (m.FileEntry("../escape", 1),), (b"\0" * 32,)
            )
            client.put(publisher.registry.manifest_key("evil", "v1"), msgspec.msgpack.encode(evil))
            client.put(publisher.config.prefix + "latest/evil", b"v1")
        finally:
            client.close()
        _, stats = node.fetch("model", Files(tmp_path / "ok"))
        same_files(source, tmp_path / "ok")
        assert set(stats.by_holder) == {publisher.segment}
        with pytest.raises(ProtocolError, match="unsafe file path"):
            node.fetch("evil", Files(tmp_path / "evil"))
        assert not (tmp_path / "escape").exists()
        assert [x.manifest.name for x in node.listing()] == ["model"]


def test_a_node_without_the_token_gets_nothing(
    etcd: EtcdServer, source: Path, tmp_path: Path
) -> None:
    wrong = config(etcd, transfer={"token": "not-the-swarm-token"})
    with P2PNode(config(etcd)) as publisher, P2PNode(wrong) as intruder:
        publisher.publish(source, "model")
        with pytest.raises(P2PError, match="stalled"):
            intruder.fetch("model", Files(tmp_path / "x"))
        assert (tmp_path / "x" / "config.json").read_bytes() == bytes(FILES["config.json"])


def test_holders_refuse_writes(etcd: EtcdServer, source: Path) -> None:
    """Peers may READ what a node serves, never WRITE it: files and memory alike."""
    with P2PNode(config(etcd)) as publisher, P2PNode(config(etcd)) as holder:
        manifest = publisher.publish(source, "model")
        memory = {name: bytearray(size) for name, size in FILES.items() if size}
        holder.fetch("model", Buffers(memory))
        records, _ = publisher.registry.holders(manifest)
        with TransferEngine(TransferConfig()) as peer:
            scratch = peer.register(bytearray(CHUNK))
            for record in records.values():
                with pytest.raises(TransferError):
                    peer.write(scratch, 0, record.segment, record.regions[0], 0, CHUNK)
        for name, buffer in memory.items():
            assert bytes(buffer) == (source / name).read_bytes()
        assert (source / "model-1.safetensors").stat().st_size == FILES["model-1.safetensors"]


def test_a_corrupt_holder_is_detected_and_skipped(
    etcd: EtcdServer, source: Path, tmp_path: Path
) -> None:
    with (
        P2PNode(config(etcd)) as publisher,
        P2PNode(config(etcd)) as bad,
        P2PNode(config(etcd)) as node,
    ):
        manifest = publisher.publish(source, "model")
        bad.fetch("model", Files(tmp_path / "bad"))
        wait_for(lambda: [x.complete for x in node.listing()] == [2], "not announced")
        for chunk in chunks_of(manifest):  # every chunk, after the holder verified it
            path = tmp_path / "bad" / manifest.files[chunk.file].path
            with open(path, "r+b") as handle:
                handle.seek(chunk.offset)
                byte = handle.read(1)
                handle.seek(chunk.offset)
                handle.write(bytes([byte[0] ^ 0xFF]))
        _, stats = node.fetch("model", Files(tmp_path / "good"))
        same_files(source, tmp_path / "good")
        # One transfer per holder: the first two chunks went one to each; the bad holder's
        # did not verify, and it was not asked again.
        assert stats.corrupt == 1
        assert stats.by_holder == {publisher.segment: sum(FILES.values())}


def test_the_publisher_may_leave_once_a_copy_exists(
    etcd: EtcdServer, source: Path, tmp_path: Path
) -> None:
    with P2PNode(config(etcd)) as seeder, P2PNode(config(etcd)) as late:
        with P2PNode(config(etcd)) as publisher:
            publisher.publish(source, "model")
            seeder.fetch("model", Files(tmp_path / "seed"))
        _, stats = late.fetch("model", Files(tmp_path / "late"))
        same_files(source, tmp_path / "late")
        assert set(stats.by_holder) == {seeder.segment}


def test_memory_of_the_wrong_size_is_refused(etcd: EtcdServer, source: Path) -> None:
    with P2PNode(config(etcd)) as publisher, P2PNode(config(etcd)) as node:
        publisher.publish(source, "model")
        buffers = {name: bytearray(size + 1) for name, size in FILES.items() if size}
        with pytest.raises(ConfigError, match="bytes, not"):
            node.fetch("model", Buffers(buffers))
        with pytest.raises(ConfigError, match="lacks"):
            node.fetch("model", Buffers({"nope": bytearray(1)}))


def test_without_the_etcd_client_a_node_says_so_and_leaves_nothing_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pyetcd", None)  # as where kvconnect[p2p] is missing
    node = P2PNode(P2PConfig.from_mapping({"etcd": "etcd://127.0.0.1:9"}))
    with pytest.raises(ConfigError, match=r"kvconnect\[etcd\]"):
        node.start()
    assert wait_no_kvconnect_threads() == []  # the engine it started is closed again
