"""Manifests: what a published object is (its files, cut into chunks, each with a SHA-256),
built by hashing a directory and checked whole when read back from etcd.

A manifest is immutable once published: ``name`` and ``version`` name exactly one list of
digests. Chunks are numbered over the files in order; a file of ``size`` bytes has
``ceil(size / chunk_bytes)`` chunks, its last one possibly shorter (an empty file has none).

SHA-256 through ``hashlib`` (OpenSSL, SHA-NI where the CPU has it: about 1.9 GB/s per core on
the CI machine) because a holder is another machine: a non-cryptographic hash would let a
hostile holder forge a chunk that verifies.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import msgspec

from kvconnect.errors import ConfigError, ProtocolError

SCHEMA = 1
DIGEST_BYTES = 32
MAX_FILES = 10_000
MAX_CHUNKS = 16_384  # bounds a manifest (512 KiB of digests) and a holder's bitmap (2 KiB)
MAX_MANIFEST_BYTES = 1 << 20  # etcd takes values up to 1.5 MiB by default
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_READ_BYTES = 4 * 1024 * 1024  # hashing reads files in pieces of this size


class FileEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One file of an object: its path relative to the object's root, and its size."""

    path: str
    size: int


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A published object (wire schema ``SCHEMA``, msgpack in etcd)."""

    schema: int
    name: str
    version: str
    chunk_bytes: int
    files: tuple[FileEntry, ...]
    digests: tuple[bytes, ...]

    @property
    def total_bytes(self) -> int:
        """The object's size: the sum of its files'."""
        return sum(entry.size for entry in self.files)

    @property
    def chunk_count(self) -> int:
        return len(self.digests)


@dataclass(frozen=True, slots=True)
class Chunk:
    """Where chunk ``index`` lies: ``length`` bytes at ``offset`` of file ``file``."""

    index: int
    file: int
    offset: int
    length: int


def check_name(what: str, value: str) -> str:
    """``value`` if it is a valid object name or version (letters, digits, ``.``, ``_``,
    ``-``; at most 128 bytes; not starting with punctuation); ConfigError otherwise."""
    if not _NAME.fullmatch(value):
        raise ConfigError(
            f"{what} must be 1-128 letters, digits, '.', '_' or '-' (not first), got {value!r}"
        )
    return value


def chunks_of(manifest: Manifest) -> list[Chunk]:
    """Every chunk of ``manifest``, by index."""
    chunks: list[Chunk] = []
    for number, entry in enumerate(manifest.files):
        for offset in range(0, entry.size, manifest.chunk_bytes):
            length = min(manifest.chunk_bytes, entry.size - offset)
            chunks.append(Chunk(len(chunks), number, offset, length))
    return chunks


def digest(view: memoryview | bytes | bytearray) -> bytes:
    """The SHA-256 of ``view`` (releases the GIL for large buffers)."""
    return hashlib.sha256(view).digest()


def encode(manifest: Manifest) -> bytes:
    return msgspec.msgpack.encode(manifest)


def decode(data: bytes) -> Manifest:
    """A manifest read from etcd, checked: ProtocolError for anything malformed or
    inconsistent (a wrong schema, unsafe paths, digests that do not match the files)."""
    try:
        manifest = msgspec.msgpack.decode(data, type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed manifest: {exc}") from exc
    try:
        validate(manifest)
    except ConfigError as exc:
        raise ProtocolError(f"invalid manifest: {exc}") from exc
    return manifest


def validate(manifest: Manifest) -> None:
    """ConfigError unless ``manifest`` is one this version can use and fetch safely."""
    if manifest.schema != SCHEMA:
        raise ConfigError(f"manifest schema {manifest.schema} (this kvconnect reads {SCHEMA})")
    check_name("name", manifest.name)
    check_name("version", manifest.version)
    if not 1 <= manifest.chunk_bytes <= 1 << 30:
        raise ConfigError(f"chunk_bytes {manifest.chunk_bytes} out of range")
    if len(manifest.files) > MAX_FILES:
        raise ConfigError(f"{len(manifest.files)} files (at most {MAX_FILES})")
    seen: set[str] = set()
    expected = 0
    for entry in manifest.files:
        check_path(entry.path)
        if entry.path in seen:
            raise ConfigError(f"file {entry.path!r} listed twice")
        seen.add(entry.path)
        if entry.size < 0:
            raise ConfigError(f"file {entry.path!r} has a negative size")
        expected += -(-entry.size // manifest.chunk_bytes)
    if expected > MAX_CHUNKS or len(manifest.digests) != expected:
        raise ConfigError(f"{len(manifest.digests)} digests for {expected} chunks")
    if any(len(d) != DIGEST_BYTES for d in manifest.digests):
        raise ConfigError("a digest is not a SHA-256")


def check_path(path: str) -> None:
    """ConfigError unless ``path`` is a plain relative path that stays inside the object's
    root (no absolute path, ``..``, empty or ``.`` part, NUL or backslash)."""
    pure = PurePosixPath(path)
    if (
        not path
        or pure.is_absolute()
        or "\0" in path
        or "\\" in path
        or str(pure) != path
        or any(part in ("", ".", "..") for part in path.split("/"))
    ):
        raise ConfigError(f"unsafe file path {path!r} in a manifest")


def build(
    root: Path, name: str, version: str | None, chunk_bytes: int, workers: int = 2
) -> Manifest:
    """Hash every regular file under ``root`` (sorted, symlinks to files followed, dot-files
    skipped) into a manifest; ``version`` None names it by content (the first 16 hex digits of
    the hash of its file list and digests). Blocks; raises ConfigError for an unusable
    directory, OSError if a file cannot be read."""
    check_name("name", name)
    files = [FileEntry(path, (root / path).stat().st_size) for path in _walk(root)]
    if not files:
        raise ConfigError(f"{root} holds no files to publish")
    chunk_bytes = fitting_chunk(chunk_bytes, [entry.size for entry in files])
    draft = Manifest(SCHEMA, name, "draft", chunk_bytes, tuple(files), ())
    pieces = chunks_of(draft)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        digests = tuple(pool.map(lambda c: _hash_chunk(root / files[c.file].path, c), pieces))
    if version is None:
        content = hashlib.sha256(encode(msgspec.structs.replace(draft, digests=digests)))
        version = content.hexdigest()[:16]
    manifest = msgspec.structs.replace(
        draft, version=check_name("version", version), digests=digests
    )
    validate(manifest)
    if len(encode(manifest)) > MAX_MANIFEST_BYTES:
        raise ConfigError(f"the manifest of {root} exceeds {MAX_MANIFEST_BYTES} bytes")
    return manifest


def fitting_chunk(chunk_bytes: int, sizes: list[int]) -> int:
    """``chunk_bytes``, doubled until files of ``sizes`` need at most MAX_CHUNKS chunks."""
    while sum(-(-size // chunk_bytes) for size in sizes) > MAX_CHUNKS:
        chunk_bytes *= 2
    return chunk_bytes


def _walk(root: Path) -> Iterator[str]:
    if not root.is_dir():
        raise ConfigError(f"not a directory: {root}")
    for directory, subdirs, names in os.walk(root, followlinks=False):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in sorted(names):
            full = Path(directory) / name
            if not name.startswith(".") and full.is_file():
                yield full.relative_to(root).as_posix()


def _hash_chunk(path: Path, chunk: Chunk) -> bytes:
    hasher = hashlib.sha256()
    buffer = bytearray(min(_READ_BYTES, chunk.length))
    with open(path, "rb", buffering=0) as handle:
        handle.seek(chunk.offset)
        left = chunk.length
        while left:
            got = handle.readinto(memoryview(buffer)[: min(left, len(buffer))])
            if not got:
                raise OSError(f"{path} is shorter than it was")
            hasher.update(memoryview(buffer)[:got])
            left -= got
    return hasher.digest()
