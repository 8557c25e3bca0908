"""Raw disk throughput on one file, the baseline of ``kvconnect bench store --tier disk``.

``fio`` (Debian package ``fio``) when it is installed, else a direct-I/O loop of this module:
``depth`` threads, each ``pwritev``/``preadv`` of one page-aligned ``block`` buffer at a time
over its own stripe of the file, opened with ``O_DIRECT`` (no page cache: what the disk tier
does). Writes end with ``fdatasync`` inside the timing (the tier makes every write durable).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

FIO_TIMEOUT = 600.0


def tool() -> str:
    """``"fio"`` if fio is on the PATH, else ``"direct-loop"`` (this module's own loop)."""
    return "fio" if shutil.which("fio") else "direct-loop"


def throughput(path: Path, op: str, block: int, total: int, depth: int) -> float:
    """Bytes per second of ``op`` (``"write"`` or ``"read"``) over ``total`` bytes of ``path``
    in ``block``-byte requests, ``depth`` at a time. ``read`` needs a file ``write`` made."""
    if tool() == "fio":
        return _fio(path, op, block, total, depth)
    return _loop(path, op, block, total, depth)


def _fio(path: Path, op: str, block: int, total: int, depth: int) -> float:
    stripe = _stripe(total, block, depth)
    argv = [
        "fio",
        "--name=kvconnect-baseline",
        f"--filename={path}",
        f"--rw={op}",
        f"--bs={block}",
        f"--size={stripe}",
        f"--offset_increment={stripe}",
        f"--numjobs={depth}",
        "--thread",
        "--ioengine=psync",
        "--direct=1",
        "--end_fsync=1",
        "--group_reporting",
        "--output-format=json",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=FIO_TIMEOUT, check=True)
    report = json.loads(out.stdout[out.stdout.index("{") :])
    return float(report["jobs"][0][op]["bw_bytes"])


def _stripe(total: int, block: int, depth: int) -> int:
    """Each worker's share of ``total``: whole blocks, at least one."""
    return max(1, total // depth // block) * block


def _loop(path: Path, op: str, block: int, total: int, depth: int) -> float:
    stripe = _stripe(total, block, depth)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    try:
        if op == "write":
            os.posix_fallocate(fd, 0, stripe * depth)
        errors: list[BaseException] = []
        workers = [
            threading.Thread(target=_worker, args=(fd, op, block, n * stripe, stripe, errors))
            for n in range(depth)
        ]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if op == "write":
            os.fdatasync(fd)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return stripe * depth / seconds


def _worker(
    fd: int, op: str, block: int, first: int, length: int, errors: list[BaseException]
) -> None:
    buffer = mmap.mmap(-1, block)  # anonymous mappings are page-aligned, as O_DIRECT needs
    try:
        buffer.write(os.urandom(block))
        call = os.pwritev if op == "write" else os.preadv
        for offset in range(first, first + length, block):
            if call(fd, [buffer], offset) != block:
                raise OSError(f"short {op} at {offset} of {fd}")
    except BaseException as exc:  # re-raised by the caller, in its thread
        errors.append(exc)
    finally:
        buffer.close()
