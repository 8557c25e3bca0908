"""Where a fetched object lands, and what a holder serves its chunks from: files in a
directory, or memory the caller owns (host buffers, pinned or CUDA tensors).

A chunk reaches a destination only after its digest matched (:meth:`Destination.store` is
given verified bytes): a destination never holds bytes that failed verification, and what it
serves is what it stored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

from kvconnect.errors import ConfigError
from kvconnect.p2p.manifest import Chunk, Manifest, check_path, chunks_of, digest
from kvconnect.p2p.swarm import Bits
from kvconnect.transfer import MemoryKind, MemoryRegion, TransferEngine

NO_REGION = -1  # an empty file: nothing to serve


class Destination(Protocol):
    """The bytes of one object on this node."""

    def open(self, manifest: Manifest, engine: TransferEngine) -> tuple[Bits, tuple[int, ...]]:
        """Prepare for ``manifest`` and publish the object's bytes as regions of ``engine``
        (read-only to peers); returns the chunks already here and verified, and the region
        id of each file. Blocks (a resumed fetch hashes what it finds); raises ConfigError if
        the destination cannot take the object, OSError for a file that cannot be created."""

    def store(self, chunk: Chunk, data: memoryview) -> None:
        """Put a verified chunk in place. Called from fetch threads, concurrently, once per
        chunk; ``data`` is borrowed for the call."""

    def close(self) -> None:
        """Release files (the regions end with the engine). Idempotent."""


class _FdSource:
    """A file's bytes for the engine to serve (a FILE region)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def read_into(self, offset: int, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"file ends before byte {offset + done}")
            done += got


class Files:
    """The object's files under ``root``, at their manifest paths. Files that exist are
    kept and their chunks verified by hash (a fetch resumes where it stopped, and a directory
    that already holds the object is served without fetching); missing ones are created.

    ``source``: the files the manifest was just built from (a publisher's): opened read-only
    (a checkpoint may sit on a read-only volume), every chunk taken as present (they were
    hashed to make the manifest), nothing stored."""

    def __init__(self, root: Path, *, source: bool = False, hash_workers: int = 2) -> None:
        self.root = root
        self._source = source
        self._workers = hash_workers
        self._fds: list[int] = []
        self._chunks: list[Chunk] = []

    def open(self, manifest: Manifest, engine: TransferEngine) -> tuple[Bits, tuple[int, ...]]:
        self._chunks = chunks_of(manifest)
        if self._source:
            for entry in manifest.files:
                self._open_source(entry.path, entry.size)
            return np.ones(len(self._chunks), dtype=bool), self._serve(manifest, engine)
        existed = [self._open_file(entry.path, entry.size) for entry in manifest.files]
        candidates = [c for c in self._chunks if existed[c.file]]
        have = np.zeros(len(self._chunks), dtype=bool)
        with ThreadPoolExecutor(self._workers) as pool:
            verified = pool.map(lambda c: self._verify(c, manifest.digests[c.index]), candidates)
            for chunk, ok in zip(candidates, verified, strict=True):
                have[chunk.index] = ok
        return have, self._serve(manifest, engine)

    def _serve(self, manifest: Manifest, engine: TransferEngine) -> tuple[int, ...]:
        return tuple(
            engine.register_source(_FdSource(fd), entry.size).id if entry.size else NO_REGION
            for fd, entry in zip(self._fds, manifest.files, strict=True)
        )

    def _open_source(self, relative: str, size: int) -> None:
        fd = os.open(self.root / relative, os.O_RDONLY | os.O_CLOEXEC)
        self._fds.append(fd)
        if os.fstat(fd).st_size != size:
            raise ConfigError(f"{relative} changed size since it was hashed")

    def _open_file(self, relative: str, size: int) -> bool:
        """Open (create) one file at its size; whether it existed with content."""
        check_path(relative)
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        root = self.root.resolve()
        if not path.parent.resolve().is_relative_to(root):
            raise ConfigError(f"{relative} would be written outside {self.root}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        self._fds.append(fd)
        existing = os.fstat(fd).st_size
        if existing != size:
            os.ftruncate(fd, size)
        return existing > 0

    def _verify(self, chunk: Chunk, expected: bytes) -> bool:
        buffer = bytearray(chunk.length)
        _FdSource(self._fds[chunk.file]).read_into(chunk.offset, memoryview(buffer))
        return digest(buffer) == expected

    def store(self, chunk: Chunk, data: memoryview) -> None:
        if self._source:
            raise ConfigError("a publisher's files are not written")
        fd, done = self._fds[chunk.file], 0
        while done < data.nbytes:
            done += os.pwrite(fd, data[done:], chunk.offset + done)

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


class Buffers:
    """The object's files in memory the caller owns: ``buffers`` maps each file's path to a
    buffer of exactly its size (a bytearray, numpy array, torch CPU tensor, pinned or not, or
    CUDA memory exposing ``__cuda_array_interface__``). The buffers are registered with the
    node's engine (peers read them) and must stay untouched until the node closes."""

    def __init__(self, buffers: Mapping[str, object]) -> None:
        self._buffers = dict(buffers)
        self._regions: list[MemoryRegion | None] = []

    def open(self, manifest: Manifest, engine: TransferEngine) -> tuple[Bits, tuple[int, ...]]:
        unknown = self._buffers.keys() - {entry.path for entry in manifest.files}
        if unknown:
            raise ConfigError(f"buffers for files the object lacks: {sorted(unknown)}")
        for entry in manifest.files:
            if entry.size == 0:
                self._regions.append(None)
                continue
            if entry.path not in self._buffers:
                raise ConfigError(f"no buffer for {entry.path}")
            region = engine.register(self._buffers[entry.path], writable=False)
            self._regions.append(region)
            if region.length != entry.size:
                raise ConfigError(
                    f"the buffer for {entry.path} has {region.length} bytes, not {entry.size}"
                )
        have = np.zeros(manifest.chunk_count, dtype=bool)
        return have, tuple(r.id if r is not None else NO_REGION for r in self._regions)

    def store(self, chunk: Chunk, data: memoryview) -> None:
        region = self._regions[chunk.file]
        assert region is not None  # a chunk belongs to a file with bytes
        if region.kind is MemoryKind.HOST:
            region.view[chunk.offset : chunk.offset + chunk.length] = data
            return
        from kvconnect.transfer.datapath.cuda import default_copier
        from kvconnect.transfer.memory import host_address

        default_copier().copy(region.address + chunk.offset, host_address(data), chunk.length)

    def close(self) -> None:
        self._regions = []
