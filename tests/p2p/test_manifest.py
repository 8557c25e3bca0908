"""Manifests: built from a directory by hashing, read back checked (an etcd value is input)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest

from kvconnect.errors import ConfigError, ProtocolError
from kvconnect.p2p import manifest as m


def _tree(root: Path) -> dict[str, bytes]:
    files = {
        "a.bin": bytes(range(256)) * 40,  # 10240 bytes: 3 chunks of 4096
        "sub/b.bin": b"x" * 4096,  # exactly one chunk
        "sub/deeper/c.txt": b"hello",
        "empty": b"",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / ".hidden").write_bytes(b"not published")
    return files


def test_build_cuts_files_into_chunks_with_their_sha256(tmp_path: Path) -> None:
    files = _tree(tmp_path)
    manifest = m.build(tmp_path, "obj", "v1", chunk_bytes=4096)
    assert [(e.path, e.size) for e in manifest.files] == [
        ("a.bin", 10240),
        ("empty", 0),
        ("sub/b.bin", 4096),
        ("sub/deeper/c.txt", 5),
    ]
    chunks = m.chunks_of(manifest)
    assert [(c.file, c.offset, c.length) for c in chunks] == [
        (0, 0, 4096),
        (0, 4096, 4096),
        (0, 8192, 2048),
        (2, 0, 4096),
        (3, 0, 5),
    ]
    for chunk in chunks:
        data = files[manifest.files[chunk.file].path][chunk.offset : chunk.offset + chunk.length]
        assert manifest.digests[chunk.index] == hashlib.sha256(data).digest()
    assert m.decode(m.encode(manifest)) == manifest


def test_a_version_by_content_changes_with_the_content(tmp_path: Path) -> None:
    _tree(tmp_path)
    first = m.build(tmp_path, "obj", None, chunk_bytes=4096)
    assert first == m.build(tmp_path, "obj", None, chunk_bytes=4096)
    (tmp_path / "sub/deeper/c.txt").write_bytes(b"hellO")
    assert m.build(tmp_path, "obj", None, chunk_bytes=4096).version != first.version


def test_objects_too_large_for_the_chunk_limit_get_larger_chunks() -> None:
    assert m.fitting_chunk(4096, [4096 * m.MAX_CHUNKS]) == 4096
    assert m.fitting_chunk(4096, [4096 * m.MAX_CHUNKS + 1]) == 8192
    assert m.fitting_chunk(4096, [1] * 10) == 4096


@pytest.mark.parametrize(
    "path", ["../etc/passwd", "/etc/passwd", "a//b", "a/./b", "a/../b", "a/", "", "a\\b", "a\0b"]
)
def test_a_manifest_with_an_unsafe_path_is_refused(tmp_path: Path, path: str) -> None:
    good = m.Manifest(m.SCHEMA, "obj", "v1", 4096, (m.FileEntry("ok", 1),), (b"\0" * 32,))
    bad = msgspec.structs.replace(good, files=(m.FileEntry(path, 1),))
    m.decode(m.encode(good))
    with pytest.raises(ProtocolError, match=r"unsafe file path|invalid manifest"):
        m.decode(m.encode(bad))


@pytest.mark.parametrize(
    "change",
    [
        {"schema": 2},
        {"name": "../x"},
        {"version": ""},
        {"digests": ()},  # fewer digests than chunks
        {"digests": (b"short",)},
        {"files": (m.FileEntry("a", 1), m.FileEntry("a", 1))},
        {"files": (m.FileEntry("a", -1),)},
        {"chunk_bytes": 0},
    ],
)
def test_an_inconsistent_manifest_is_refused(change: dict[str, object]) -> None:
    good = m.Manifest(m.SCHEMA, "obj", "v1", 4096, (m.FileEntry("a", 1),), (b"\0" * 32,))
    with pytest.raises(ProtocolError):
        m.decode(m.encode(msgspec.structs.replace(good, **change)))


@pytest.mark.parametrize("data", [b"", b"\xc1", msgspec.msgpack.encode({"schema": 1})])
def test_garbage_is_not_a_manifest(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed manifest"):
        m.decode(data)


def test_names_are_checked(tmp_path: Path) -> None:
    _tree(tmp_path)
    for name in ("", ".x", "a/b", "a b", "x" * 129):
        with pytest.raises(ConfigError):
            m.build(tmp_path, name, "v1", 4096)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ConfigError, match="no files"):
        m.build(tmp_path / "nothing", "obj", "v1", 4096)
    with pytest.raises(ConfigError, match="not a directory"):
        m.build(tmp_path / "a.bin", "obj", "v1", 4096)
