"""Mooncake Store (master + distributed store client) driven for kvconnect's benchmark.

A standalone script: it runs with any interpreter that has ``mooncake`` (the
``mooncake-transfer-engine-non-cuda`` wheel) and numpy, and imports nothing from kvconnect.

It starts ``mooncake_master`` (with its embedded HTTP metadata server) on 127.0.0.1 with free
ports, then the store server side chosen by ``--mode``:

* ``tcp``: a holder child process (this script, ``--role holder``) mounts a ``--segment``-byte
  global segment; the bench client mounts nothing (``global_segment_size=0``), so every byte
  moves over the Transfer Engine's TCP transport.
* ``same-host``: the wheel's ``mooncake_client`` ("real client") owns the ``--segment`` bytes;
  the bench client is a ``setup_dummy`` client whose registered buffer is a memfd shared with
  it, so data moves by memcpy between two processes on one host.
* ``embedded``: the bench client mounts the segment itself (Mooncake short-circuits to memcpy
  inside one process); a reference point, not a client/server deployment.

It prints ``{"ready": true, ...}`` and answers JSON commands on stdin, one per line, with one
JSON line each (``{"error": "..."}`` if a command fails):

* ``{"op": "put"|"get", "size": S, "count": N}``: bytes API, per-op seconds.
* ``{"op": "batch_put_from"|"batch_get_into", "size": S, "batch": B, "count": N}``: zero-copy
  on the registered buffer, per-call seconds (N calls of B keys).
* ``{"op": "exists"|"batch_exists", "batch": B, "count": N}``: ``is_exist`` (cycling over B
  keys) or ``batch_is_exist`` (B keys) on existing keys, per-call seconds.
* ``{"op": "remove_all"}``: ``remove_all(force=True)``; also drops the fill capacity.
* ``{"op": "warm", "fraction": 0.9}``: writes that fraction of the store server's segment
  once (so later timings don't include its first-touch page faults), then ``remove_all``.
* ``{"op": "master_rss"}``: ``{"rss": bytes}`` of the ``mooncake_master`` process.
* ``{"op": "fill", "objects": N, "min_size": a, "max_size": b}``: adds N objects (fixed-width
  ``key_len``-character keys) as fast as possible. Their bytes land in "alias" segments: a
  child process mounts one ``--alias-segment``-byte memfd many times over, so the master sees
  as much capacity as needed while the machine holds one copy (object contents are overwritten
  by each other; only metadata is of interest). Data ops are refused until ``remove_all``.
* ``{"op": "batch_exists_latency", "batch": B, "count": N}``: ``batch_is_exist`` of B random
  filled keys, per-call seconds.
* ``{"op": "throughput", "kind": "batch_exists"|"put", "processes": P, "seconds": S,
  "batch": B}``: P loader processes (this script, ``--role loader``), each its own client of
  the master, call ``batch_is_exist`` on B stored keys or ``put`` 64-byte values as fast as
  they can for S seconds, all at once; ``{"calls": total}`` (the master's throughput).
* ``{"op": "offload", "size": S, "count": N, "wait": W}`` (``same-host --offload DIR``: the
  master with ``--enable_offload --offload_on_evict``, the real client with
  ``--enable_offload`` and ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH=DIR``, bucket backend): N puts
  of S bytes (more than the segment), then up to W seconds watching DIR grow; reports the put
  codes, the bytes in DIR, seconds from the first put to DIR's last growth, and how many of the
  first 32 objects read back right.

With ``--role servers`` it only starts the master and ``--holders`` holder processes of
``--segment`` bytes each, prints ``{"ready": true, "master": ..., "metadata": ..., "holders":
[pid, ...], "master_pid": pid}`` and waits for EOF on stdin: a store for a Mooncake client in
another process (SGLang's ``mooncake`` HiCache backend, for ``kvconnect bench sglang``).

Put and get paths are verified once per value size (checksum compare of a round trip). EOF on
stdin (or SIGTERM) closes the client and stops every child process.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import ctypes
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import mooncake
import numpy as np
import numpy.typing as npt
from mooncake.store import MooncakeDistributedStore

HOST = "127.0.0.1"
MIB = 1 << 20
GIB = 1 << 30
READY_TIMEOUT = 60.0
FILL_HEADROOM = 0.8  # fill so that the mounted capacity stays under this ratio (no eviction)

Buffer = npt.NDArray[np.uint8]
_DATA_OPS = frozenset({"put", "get", "batch_put_from", "batch_get_into", "warm"})


class OpError(RuntimeError):
    """A Mooncake call returned an error code or wrong data."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """Child preexec: get SIGTERM when the runner dies, so no process outlives it."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _binary(name: str) -> str:
    path = Path(mooncake.__file__).parent / name
    if not path.is_file():
        path = Path(sys.executable).parent / name
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return str(path)


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((HOST, port)) == 0


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OpError(f"no VmRSS for pid {pid}")


class Child:
    """A child process; stopped by closing its stdin (Python roles) or by SIGTERM (binaries)."""

    def __init__(
        self, argv: list[str], log: Path | None, *, pipe: bool, env: dict[str, str] | None = None
    ) -> None:
        self.name = Path(argv[0]).name if argv[0] != sys.executable else argv[-1]
        self.log = open(log, "ab") if log is not None else None  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipe else (self.log or subprocess.DEVNULL),
            stderr=self.log or subprocess.DEVNULL,
            text=True,
            env=env,
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise OpError(f"child {self.name} exited (rc={self.proc.wait()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise OpError(str(reply["error"]))
        return reply

    def stop(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=30)
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.log is not None:
            self.log.close()


class Master:
    """``mooncake_master`` with the embedded HTTP metadata server, on free loopback ports."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.rpc_port = _free_port()
        self.http_port = _free_port()
        self.admin_port = _free_port()
        argv = [
            _binary("mooncake_master"),
            f"--rpc_address={HOST}",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.admin_port}",
            "--enable_metric_reporting=false",
            f"--eviction_high_watermark_ratio={args.eviction_high_watermark}",
            f"--eviction_ratio={args.eviction_ratio}",
            f"--client_ttl={args.client_ttl}",
        ]
        if args.offload:
            argv += ["--enable_offload=true", "--offload_on_evict=true"]
        self.child = Child(argv, _log(args, "master"), pipe=False)
        self.pid = self.child.proc.pid
        self.address = f"{HOST}:{self.rpc_port}"
        self.metadata = f"http://{HOST}:{self.http_port}/metadata"
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        url = f"http://{HOST}:{self.admin_port}/health"
        while time.monotonic() < deadline:
            if self.child.proc.poll() is not None:
                raise OpError(f"mooncake_master exited with {self.child.proc.returncode}")
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(url, timeout=1) as response:
                    health = json.loads(response.read())
                if health.get("service_ready") and _port_open(self.http_port):
                    return
            time.sleep(0.05)
        raise OpError("mooncake_master not ready")

    def rss(self) -> int:
        return _rss(self.pid)


def _log(args: argparse.Namespace, name: str) -> Path | None:
    log_dir: str | None = args.log_dir
    return Path(log_dir) / f"{name}.log" if log_dir else None


def _child_argv(args: argparse.Namespace, master: Master, segment: int, name: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--role", "holder"]
    argv += ["--master", master.address, "--metadata", master.metadata]
    argv += ["--segment", str(segment), "--name", name]
    return argv


class Store:
    """Typed veneer over ``MooncakeDistributedStore`` (return conventions in the docstrings)."""

    def __init__(self) -> None:
        self.raw: Any = MooncakeDistributedStore()

    def setup(self, metadata: str, master: str, segment: int, local_buffer: int) -> None:
        """``setup`` → 0 on success."""
        rc = int(self.raw.setup(HOST, metadata, segment, local_buffer, "tcp", "", master))
        if rc != 0:
            raise OpError(f"setup returned {rc}")

    def setup_dummy(self, pool: int, local_buffer: int, server: str) -> None:
        """``setup_dummy`` (client of a ``mooncake_client``) → 0 on success."""
        rc = int(self.raw.setup_dummy(pool, local_buffer, server))
        if rc != 0:
            raise OpError(f"setup_dummy returned {rc}")

    def put(self, key: str, value: bytes) -> int:
        """0, or a negative ErrorCode; an existing key → 0 and the value is left unchanged."""
        return int(self.raw.put(key, value))

    def get(self, key: str) -> bytes:
        """The value, or ``b""`` when missing."""
        value: bytes = self.raw.get(key)
        return value

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """Per-key 0 or a negative ErrorCode (-200: no space)."""
        return [int(rc) for rc in self.raw.batch_put_from(keys, ptrs, sizes)]

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """Per-key bytes read, or a negative ErrorCode (-704: missing, -600: too small)."""
        return [int(rc) for rc in self.raw.batch_get_into(keys, ptrs, sizes)]

    def is_exist(self, key: str) -> int:
        """1 present, 0 missing, -1 error (a hit grants a read lease)."""
        return int(self.raw.is_exist(key))

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """Per-key 1 / 0 / -1."""
        return [int(rc) for rc in self.raw.batch_is_exist(keys)]

    def remove_all(self) -> int:
        """Number of objects removed, or a negative ErrorCode."""
        return int(self.raw.remove_all(True))

    def register_buffer(self, ptr: int, size: int) -> None:
        rc = int(self.raw.register_buffer(ptr, size))
        if rc != 0:
            raise OpError(f"register_buffer returned {rc}")

    def alloc_from_mem_pool(self, size: int) -> int:
        """Dummy mode: a memfd region shared with the real client, or 0."""
        return int(self.raw.alloc_from_mem_pool(size))

    def mount_segment(self, path: str, size: int) -> None:
        """``mount_segment`` mmaps ``path`` (MAP_SHARED) → ``{"ret": 0, "segment_ids": [...]}``."""
        result: dict[str, Any] = self.raw.mount_segment(path, size, 0, "tcp", "")
        if int(result["ret"]) != 0:
            raise OpError(f"mount_segment returned {result}")

    def close(self) -> None:
        self.raw.close()


def _holder(args: argparse.Namespace) -> None:
    """A store server process: mounts ``--segment`` bytes; on ``{"alias": k, "size": s}`` it
    mounts k more segments of s bytes that all map the same memfd."""
    store = Store()
    store.setup(args.metadata, args.master, args.segment, 0)
    print(json.dumps({"ready": True}), flush=True)
    alias_fd = -1
    alias_size = 0
    mounted = 0
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if alias_fd < 0:
                    alias_size = int(cmd["size"])
                    alias_fd = os.memfd_create("mooncake-store-runner-alias")
                    os.ftruncate(alias_fd, alias_size)
                for _ in range(int(cmd["alias"])):
                    store.mount_segment(f"/proc/self/fd/{alias_fd}", alias_size)
                    mounted += alias_size
                print(json.dumps({"mounted": mounted}), flush=True)
            except (OpError, OSError, KeyError, ValueError) as error:
                print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
    finally:
        store.close()
        if alias_fd >= 0:
            os.close(alias_fd)


class Bench:
    """The benchmark client: answers one command at a time."""

    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        self.args = args
        self.rng = np.random.default_rng(20261129)
        self.master = Master(args)
        stack.callback(self.master.child.stop)
        self.store = Store()
        self.server: Child | None = None
        if args.mode == "tcp":
            self.server = Child(
                _child_argv(args, self.master, args.segment, "holder"),
                _log(args, "holder"),
                pipe=True,
            )
            stack.callback(self.server.stop)
            self.server.reply()
        elif args.mode == "same-host":
            self.server = self._start_real_client()
            stack.callback(self.server.stop)
        self.alias: Child | None = None
        self.alias_bytes = 0
        stack.callback(self._stop_alias)
        segment = args.segment if args.mode == "embedded" else 0
        if args.mode == "same-host":
            assert self.server is not None
            server = f"{HOST}:{self.real_client_port}"
            self.store.setup_dummy(args.buffer + args.local_buffer, args.local_buffer, server)
        else:
            self.store.setup(self.master.metadata, self.master.address, segment, args.local_buffer)
        stack.callback(self.store.close)
        self.buf = self._buffer(args.buffer)
        self.base: int = self.buf.ctypes.data
        self.commands = 0
        self.verified: set[tuple[str, int]] = set()
        self.fills: list[tuple[str, int]] = []  # (key prefix, index width) per fill
        self.fill_starts: list[int] = []
        self.fill_objects = 0
        self.fill_bytes = 0

    def _start_real_client(self) -> Child:
        self.real_client_port = _free_port()
        argv = [
            _binary("mooncake_client"),
            f"--host={HOST}",
            f"--port={self.real_client_port}",
            f"--global_segment_size={self.args.segment}",
            "--local_buffer_size=0",
            f"--master_server_address={self.master.address}",
            f"--metadata_server={self.master.metadata}",
            "--protocol=tcp",
            f"--threads={self.args.real_client_threads}",
        ]
        env = None
        if self.args.offload:
            argv.append("--enable_offload=true")
            env = dict(
                os.environ,
                MOONCAKE_OFFLOAD_FILE_STORAGE_PATH=self.args.offload,
                MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR="bucket_storage_backend",
                MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS="1",
            )
        child = Child(argv, _log(self.args, "real_client"), pipe=False, env=env)
        deadline = time.monotonic() + READY_TIMEOUT
        while not _port_open(self.real_client_port):
            if child.proc.poll() is not None or time.monotonic() > deadline:
                child.stop()
                raise OpError("mooncake_client did not start")
            time.sleep(0.05)
        return child

    def _buffer(self, size: int) -> Buffer:
        if self.args.mode == "same-host":
            ptr = self.store.alloc_from_mem_pool(size)
            if ptr == 0:
                raise OpError("alloc_from_mem_pool failed")
            buf: Buffer = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))
        else:
            buf = np.empty(size, dtype=np.uint8)
        buf[:] = np.frombuffer(self.rng.bytes(size), dtype=np.uint8)
        self.store.register_buffer(buf.ctypes.data, size)
        return buf

    def _stop_alias(self) -> None:
        if self.alias is not None:
            self.alias.stop()
            self.alias = None
            self.alias_bytes = 0

    # ---- commands -------------------------------------------------------------------------

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.commands += 1
        prefix = f"r{os.getpid()}c{self.commands}"
        op = cmd["op"]
        if self.alias is not None and op in _DATA_OPS:
            raise OpError("fill capacity (aliased memory) is mounted: send remove_all first")
        if op in ("put", "get"):
            return {"seconds": self._bytes_op(op, prefix, int(cmd["size"]), int(cmd["count"]))}
        if op in ("batch_put_from", "batch_get_into"):
            size, batch, count = int(cmd["size"]), int(cmd["batch"]), int(cmd["count"])
            return {"seconds": self._zero_copy(op, prefix, size, batch, count)}
        if op in ("exists", "batch_exists"):
            batch, count = int(cmd.get("batch", 1)), int(cmd["count"])
            size = int(cmd.get("size", 4096))
            return {"seconds": self._exists(op, prefix, batch, count, size)}
        if op == "remove_all":
            removed = self.store.remove_all()
            if removed < 0:
                raise OpError(f"remove_all returned {removed}")
            self._stop_alias()
            self.fills.clear()
            self.fill_starts.clear()
            self.fill_objects = self.fill_bytes = 0
            return {"removed": removed}
        if op == "warm":
            return self._warm(prefix, float(cmd.get("fraction", 0.9)))
        if op == "master_rss":
            return {"rss": self.master.rss()}
        if op == "fill":
            return self._fill(
                prefix,
                int(cmd["objects"]),
                int(cmd["min_size"]),
                int(cmd["max_size"]),
                int(cmd.get("batch", 256)),
                int(cmd.get("key_len", 64)),
            )
        if op == "batch_exists_latency":
            return {"seconds": self._fill_exists(int(cmd.get("batch", 128)), int(cmd["count"]))}
        if op == "throughput":
            kind, processes = str(cmd["kind"]), int(cmd["processes"])
            return self._throughput(
                prefix, kind, processes, float(cmd["seconds"]), int(cmd["batch"])
            )
        if op == "offload":
            return self._offload(prefix, int(cmd["size"]), int(cmd["count"]), float(cmd["wait"]))
        raise OpError(f"unknown op {op!r}")

    def _bytes_op(self, op: str, prefix: str, size: int, count: int) -> list[float]:
        value = self.rng.bytes(size)
        if ("bytes", size) not in self.verified:
            self._check(self.store.put(f"{prefix}-v", value) == 0, "verify put")
            got = self.store.get(f"{prefix}-v")
            self._check(_digest(got) == _digest(value), f"bytes round trip of {size} B")
            self.verified.add(("bytes", size))
        keys = [f"{prefix}-{i}" for i in range(count)]
        seconds = []
        if op == "put":
            for key in keys:
                start = time.perf_counter()
                rc = self.store.put(key, value)
                seconds.append(time.perf_counter() - start)
                self._check(rc == 0, f"put returned {rc}")
            return seconds
        for key in keys:
            rc = self.store.put(key, value)
            self._check(rc == 0, f"put returned {rc}")
        for key in keys:
            start = time.perf_counter()
            got = self.store.get(key)
            seconds.append(time.perf_counter() - start)
            self._check(len(got) == size, f"get returned {len(got)} of {size} B")
        return seconds

    def _zero_copy(self, op: str, prefix: str, size: int, batch: int, count: int) -> list[float]:
        if size * batch > self.buf.nbytes:
            raise OpError(f"{batch} x {size} B exceeds the {self.buf.nbytes} B buffer")
        ptrs = [self.base + j * size for j in range(batch)]
        sizes = [size] * batch
        if ("zero-copy", size) not in self.verified:
            self._verify_zero_copy(prefix, ptrs, sizes)
            self.verified.add(("zero-copy", size))
        calls = [[f"{prefix}-{c}-{j}" for j in range(batch)] for c in range(count)]
        seconds = []
        if op == "batch_put_from":
            for keys in calls:
                start = time.perf_counter()
                rcs = self.store.batch_put_from(keys, ptrs, sizes)
                seconds.append(time.perf_counter() - start)
                self._check(all(rc == 0 for rc in rcs), f"batch_put_from returned {_bad(rcs)}")
            return seconds
        for keys in calls:
            rcs = self.store.batch_put_from(keys, ptrs, sizes)
            self._check(all(rc == 0 for rc in rcs), f"batch_put_from returned {_bad(rcs)}")
        for keys in calls:
            start = time.perf_counter()
            rcs = self.store.batch_get_into(keys, ptrs, sizes)
            seconds.append(time.perf_counter() - start)
            self._check(all(rc == size for rc in rcs), f"batch_get_into returned {_bad(rcs)}")
        return seconds

    def _verify_zero_copy(self, prefix: str, ptrs: list[int], sizes: list[int]) -> None:
        total = sum(sizes)
        self.buf[:total] = np.frombuffer(self.rng.bytes(total), dtype=np.uint8)
        expected = _digest(self.buf[:total])
        keys = [f"{prefix}-v{j}" for j in range(len(ptrs))]
        rcs = self.store.batch_put_from(keys, ptrs, sizes)
        self._check(all(rc == 0 for rc in rcs), f"verify batch_put_from returned {_bad(rcs)}")
        self.buf[:total] = 0
        rcs = self.store.batch_get_into(keys, ptrs, sizes)
        self._check(rcs == sizes, f"verify batch_get_into returned {_bad(rcs)}")
        self._check(_digest(self.buf[:total]) == expected, f"zero-copy round trip of {sizes[0]} B")

    def _exists(self, op: str, prefix: str, batch: int, count: int, size: int) -> list[float]:
        value = self.rng.bytes(size)
        keys = [f"{prefix}-{j}" for j in range(batch)]
        for key in keys:
            rc = self.store.put(key, value)
            self._check(rc == 0, f"put returned {rc}")
        seconds = []
        for i in range(count):
            if op == "exists":
                key = keys[i % batch]
                start = time.perf_counter()
                found = self.store.is_exist(key)
                seconds.append(time.perf_counter() - start)
                self._check(found == 1, f"is_exist returned {found}")
            else:
                start = time.perf_counter()
                flags = self.store.batch_is_exist(keys)
                seconds.append(time.perf_counter() - start)
                self._check(all(f == 1 for f in flags), f"batch_is_exist returned {_bad(flags)}")
        return seconds

    def _throughput(
        self, prefix: str, kind: str, processes: int, seconds: float, batch: int
    ) -> dict[str, Any]:
        if kind not in ("batch_exists", "put"):
            raise OpError(f"unknown throughput kind {kind!r}")
        for key in _load_keys(prefix, batch):
            rc = self.store.put(key, b"x" * 64)
            self._check(rc == 0, f"put returned {rc}")
        loaders = []
        try:
            for n in range(processes):
                argv = [sys.executable, os.path.abspath(__file__), "--role", "loader"]
                argv += ["--master", self.master.address, "--metadata", self.master.metadata]
                argv += ["--kind", kind, "--batch", str(batch), "--name", f"{prefix}:{n}"]
                loaders.append(Child(argv, _log(self.args, f"loader{n}"), pipe=True))
            for loader in loaders:
                loader.reply()  # set up and waiting
            for loader in loaders:  # all start together
                assert loader.proc.stdin is not None
                loader.proc.stdin.write(json.dumps({"seconds": seconds}) + "\n")
                loader.proc.stdin.flush()
            return {"calls": sum(int(loader.reply()["calls"]) for loader in loaders)}
        finally:
            for loader in loaders:
                loader.stop()
            self.store.remove_all()

    def _warm(self, prefix: str, fraction: float) -> dict[str, Any]:
        """Write ``fraction`` of the store server's segment once, then ``remove_all``."""
        size = min(16 * MIB, self.buf.nbytes)
        batch = self.buf.nbytes // size
        objects = int(self.args.segment * fraction) // size
        start = time.perf_counter()
        written = 0
        for first in range(0, objects, batch):
            n = min(batch, objects - first)
            keys = [f"{prefix}-{i}" for i in range(first, first + n)]
            rcs = self.store.batch_put_from(
                keys, [self.base + j * size for j in range(n)], [size] * n
            )
            written += size * sum(1 for rc in rcs if rc == 0)
        removed = self.store.remove_all()
        return {"bytes": written, "removed": removed, "seconds": time.perf_counter() - start}

    def _ensure_alias(self, needed: int) -> None:
        """Mount aliased capacity until ``needed`` bytes of it exist."""
        segment = self.args.alias_segment
        missing = -(-(needed - self.alias_bytes) // segment)
        if missing <= 0:
            return
        if self.alias is None:
            self.alias = Child(
                _child_argv(self.args, self.master, 0, "alias"), _log(self.args, "alias"), pipe=True
            )
            self.alias.reply()
        reply = self.alias.request({"alias": missing, "size": segment})
        self.alias_bytes = int(reply["mounted"])

    def _fill(
        self, prefix: str, objects: int, min_size: int, max_size: int, batch: int, key_len: int
    ) -> dict[str, Any]:
        batch = max(1, min(batch, self.buf.nbytes // max_size))
        expected = self.fill_bytes + objects * (min_size + max_size) // 2
        rss_before_mount = self.master.rss()
        self._ensure_alias(int(expected / FILL_HEADROOM) + self.args.alias_segment)
        rss_before = self.master.rss()
        width = key_len - len(prefix) - 1
        if width < len(str(objects)):
            raise OpError(f"key_len {key_len} too short")
        failed: dict[int, int] = {}
        written = 0
        start = time.perf_counter()
        for first in range(0, objects, batch):
            n = min(batch, objects - first)
            sizes = self.rng.integers(min_size, max_size + 1, n).tolist()
            offsets = np.concatenate(([0], np.cumsum(sizes[:-1]))).tolist()
            keys = [f"{prefix}-{i:0{width}d}" for i in range(first, first + n)]
            rcs = self.store.batch_put_from(keys, [self.base + o for o in offsets], sizes)
            for rc, size in zip(rcs, sizes, strict=True):
                if rc == 0:
                    written += size
                else:
                    failed[rc] = failed.get(rc, 0) + 1
        seconds = time.perf_counter() - start
        rss_after = self.master.rss()
        if failed:
            raise OpError(f"fill: failed puts by error code {failed}")
        self.fill_starts.append(self.fill_objects)
        self.fills.append((f"{prefix}-", width))
        self.fill_objects += objects
        self.fill_bytes += written
        return {
            "objects": objects,
            "bytes": written,
            "seconds": seconds,
            "total_objects": self.fill_objects,
            "total_bytes": self.fill_bytes,
            "mounted_bytes": self.alias_bytes,
            "master_rss_before_mount": rss_before_mount,
            "master_rss_before": rss_before,
            "master_rss_after": rss_after,
        }

    def _fill_key(self, index: int) -> str:
        slot = bisect.bisect_right(self.fill_starts, index) - 1
        prefix, width = self.fills[slot]
        return f"{prefix}{index - self.fill_starts[slot]:0{width}d}"

    def _fill_exists(self, batch: int, count: int) -> list[float]:
        if self.fill_objects == 0:
            raise OpError("nothing filled")
        seconds = []
        for _ in range(count):
            picks = self.rng.integers(0, self.fill_objects, batch).tolist()
            keys = [self._fill_key(i) for i in picks]
            start = time.perf_counter()
            flags = self.store.batch_is_exist(keys)
            seconds.append(time.perf_counter() - start)
            self._check(all(f == 1 for f in flags), f"batch_is_exist returned {_bad(flags)}")
        return seconds

    @staticmethod
    def _check(ok: bool, what: str) -> None:
        if not ok:
            raise OpError(what)

    def _offload(self, prefix: str, size: int, count: int, wait: float) -> dict[str, Any]:
        if not self.args.offload:
            raise OpError("offload needs --offload DIR")
        values = [self.rng.bytes(size) for _ in range(min(count, 32))]
        start = time.monotonic()
        codes = [self.store.put(f"{prefix}-{i}", values[i % len(values)]) for i in range(count)]
        grown, last = _dir_bytes(self.args.offload), time.monotonic()
        # the whole ``wait`` for a first write; once writing, until 3 s without growth
        while time.monotonic() < start + wait and (not grown or time.monotonic() < last + 3):
            time.sleep(0.1)
            now = _dir_bytes(self.args.offload)
            if now != grown:
                grown, last = now, time.monotonic()
        right = 0
        for i, value in enumerate(values):
            with contextlib.suppress(OpError):
                right += self.store.get(f"{prefix}-{i}") == value
        return {
            "put_codes": _bad(codes),
            "disk_bytes": grown,
            "seconds": last - start,
            "early_read_right": right,
            "early_checked": len(values),
        }


def _dir_bytes(root: str) -> int:
    """Bytes of the files under ``root``."""
    return sum((Path(d) / f).stat().st_size for d, _, files in os.walk(root) for f in files)


def _digest(data: bytes | Buffer) -> str:
    view = data if isinstance(data, bytes) else data.data
    return hashlib.blake2b(view, digest_size=16).hexdigest()


def _bad(codes: list[int]) -> str:
    counts: dict[int, int] = {}
    for code in codes:
        counts[code] = counts.get(code, 0) + 1
    return ", ".join(f"{code} x{n}" for code, n in sorted(counts.items()))


def _bench(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as stack:
        bench = Bench(args, stack)
        ready = {"ready": True, "mode": args.mode, "master_pid": bench.master.pid}
        print(json.dumps(ready), flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                reply = bench.handle(json.loads(line))
            except (OpError, KeyError, ValueError, TypeError) as error:
                reply = {"error": f"{type(error).__name__}: {error}"}
            print(json.dumps(reply), flush=True)


def _load_keys(prefix: str, batch: int) -> list[str]:
    return [f"{prefix}-load-{j}" for j in range(batch)]


def _loader(args: argparse.Namespace) -> None:
    """One client of the throughput op: set up, wait for ``{"seconds": S}``, call as fast as
    it can for S seconds, print ``{"calls": n}``."""
    store = Store()
    store.setup(args.metadata, args.master, 0, 16 * MIB)
    try:
        print(json.dumps({"ready": True}), flush=True)
        seconds = float(json.loads(sys.stdin.readline())["seconds"])
        prefix = args.name.rpartition(":")[0]
        keys = _load_keys(prefix, args.batch)
        value = b"y" * 64
        calls = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if args.kind == "batch_exists":
                flags = store.batch_is_exist(keys)
                if not all(f == 1 for f in flags):
                    raise OpError(f"batch_is_exist returned {_bad(flags)}")
            else:
                rc = store.put(f"{args.name}-{calls}", value)
                if rc != 0:
                    raise OpError(f"put returned {rc}")
            calls += 1
        print(json.dumps({"calls": calls}), flush=True)
    finally:
        store.close()


def _servers(args: argparse.Namespace) -> None:
    """A master and ``--holders`` store server processes, until EOF on stdin."""
    with contextlib.ExitStack() as stack:
        master = Master(args)
        stack.callback(master.child.stop)
        holders = []
        for n in range(args.holders):
            holder = Child(
                _child_argv(args, master, args.segment, f"holder{n}"),
                _log(args, f"holder{n}"),
                pipe=True,
            )
            stack.callback(holder.stop)
            holder.reply()
            holders.append(holder.proc.pid)
        ready: dict[str, Any] = {"master": master.address, "metadata": master.metadata}
        ready.update(holders=holders, master_pid=master.pid)
        print(json.dumps({"ready": True, **ready}), flush=True)
        sys.stdin.read()


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_now(signum: int, frame: object) -> None:
    """Holder: SIGTERM comes from ``Child.stop`` or from the runner's death (PDEATHSIG); the
    master may be gone, and ``close()`` would then wait for RPC timeouts."""
    os._exit(128 + signum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    roles = ["bench", "holder", "servers", "loader"]
    parser.add_argument("--role", choices=roles, default="bench")
    parser.add_argument("--mode", choices=["tcp", "same-host", "embedded"], default="tcp")
    parser.add_argument("--segment", type=int, default=4 * GIB, help="store server bytes")
    parser.add_argument("--buffer", type=int, default=256 * MIB, help="registered client buffer")
    parser.add_argument("--local-buffer", type=int, default=64 * MIB, help="bytes-API staging")
    parser.add_argument("--alias-segment", type=int, default=GIB, help="fill: bytes per alias")
    parser.add_argument("--eviction-high-watermark", type=float, default=0.95)
    parser.add_argument("--eviction-ratio", type=float, default=0.05)
    parser.add_argument("--client-ttl", type=int, default=30)
    parser.add_argument("--real-client-threads", type=int, default=1)
    parser.add_argument("--holders", type=int, default=1, help="servers: store processes")
    parser.add_argument("--log-dir", default=None, help="keep child logs here")
    parser.add_argument("--offload", default="", help="same-host: SSD offload into this dir")
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--metadata", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=128, help=argparse.SUPPRESS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _exit_now if args.role == "holder" else _on_sigterm)
    roles_main = {"holder": _holder, "servers": _servers, "bench": _bench, "loader": _loader}
    roles_main[args.role](args)


if __name__ == "__main__":
    main()
