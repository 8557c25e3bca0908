"""A small real file system for disk-fault tests: an ext4 image on a loop device (root only;
tests skip with the reason where it cannot be mounted)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def loop_fs(directory: Path, size: str = "16M") -> Iterator[tuple[Path, Path]]:
    """Mount a fresh ext4 image of ``size`` (no reserved blocks) under ``directory``: yields
    (mount point, image file); unmounted after."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 is not installed")
    image, mount = directory / "fs.img", directory / "mnt"
    mount.mkdir()
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-m", "0", str(image)], check=True)
    result = subprocess.run(
        ["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        pytest.skip(f"cannot loop-mount an ext4 image: {result.stderr.strip()}")
    try:
        yield mount, image
    finally:
        # Lazy: a test that failed may leave a process with files open there.
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> int:
    """Take every free block of the file system ``directory`` is on; the errno that stopped it."""
    with open(directory / "ballast", "wb", buffering=0) as f:
        while True:
            try:
                f.write(b"\xab" * 4096)
            except OSError as e:
                return e.errno or 0
