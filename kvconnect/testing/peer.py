"""A transfer-engine peer in its own process, driven over stdin/stdout with JSON lines.

Tests and benchmarks use it to put the other end of a transfer in a real separate process::

    with PeerProcess(config={"transport": "tcp"}, shared=1 << 20) as peer:
        engine.read(local, 0, peer.name, peer.regions["shared"], 0, 4096)
        assert peer.sha256("shared", 0, 4096) == ...

The child prints one hello line (segment name, region ids, pid), then answers one command per
line until stdin closes. Commands: ``sha256``, ``fill``, ``transfer`` (act as initiator against
another segment), ``stats``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvconnect.errors import KVConnectError
from kvconnect.lifecycle import Closing
from kvconnect.transfer import TransferConfig, TransferOp, TransferRequest
from kvconnect.transfer.engine import TransferEngine
from kvconnect.transfer.memory import MemoryRegion


def pattern(seed: int, length: int) -> np.ndarray:
    """Deterministic pseudo-random bytes: the content of a region filled with ``seed``."""
    return np.frombuffer(np.random.default_rng(seed).bytes(length), dtype=np.uint8)


class ChildProcess(Closing):
    """A child process driven over stdin/stdout with JSON lines: it prints one hello line,
    then answers one command per line until stdin closes (the protocol of this module's
    peer and of the test suite's prefill peer)."""

    def __init__(
        self, args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float
    ) -> None:
        """Start ``args``; :attr:`hello` is the child's first line."""
        self._timeout = timeout
        self.proc = subprocess.Popen(
            list(args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        try:
            self.hello = self._read_line()
        except BaseException:  # a child that failed to start must not leak its pipes
            self.close()
            raise
        self.pid: int = self.hello["pid"]

    def call(self, command: Mapping[str, Any]) -> dict[str, Any]:
        """Send one command and return its reply (raises RuntimeError on an error reply)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(dict(command)) + "\n")
        self.proc.stdin.flush()
        reply = self._read_line()
        if "error" in reply:
            raise RuntimeError(f"{self._what()}: {reply['error']}")
        return reply

    def kill(self) -> None:
        """SIGKILL the child."""
        self.proc.kill()
        self.proc.wait(timeout=self._timeout)

    def close(self) -> None:
        """Close stdin (the child closes what it runs and exits) and reap it; kills it if it
        does not exit in time (e.g. still stopped)."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        with contextlib.suppress(OSError):  # a killed child leaves nothing to flush
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=self._timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=self._timeout)
        self.proc.stdout.close()

    def _what(self) -> str:
        return "peer"

    def _read_line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        end = time.monotonic() + self._timeout
        while True:
            remaining = end - time.monotonic()
            ready = remaining > 0 and select.select([self.proc.stdout], [], [], remaining)[0]
            if not ready:
                self.proc.kill()
                raise RuntimeError(f"{self._what()} did not answer within {self._timeout}s")
            line = self.proc.stdout.readline()
            if line:
                reply: dict[str, Any] = json.loads(line)
                return reply
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self._what()} exited with status {self.proc.returncode}")


class PeerProcess(ChildProcess):
    """Start ``python -m kvconnect.testing.peer`` and talk to it."""

    def __init__(
        self,
        *,
        config: Mapping[str, Any] | None = None,
        shared: int = 0,
        private: int = 0,
        shared_writable: bool = True,
        seed: int | None = None,
        netns: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        """``shared``/``private``: bytes of shared (allocate) and private (register) memory;
        ``shared_writable=False`` allocates the shared one read-only.

        ``seed`` fills both with :func:`pattern` (shared with ``seed``, private ``seed + 1``).
        ``netns`` runs the peer inside that network namespace (``ip netns exec``).
        """
        args = [sys.executable, "-m", "kvconnect.testing.peer"]
        args += ["--config", json.dumps(dict(config or {}))]
        args += ["--shared", str(shared), "--private", str(private)]
        if not shared_writable:
            args.append("--shared-readonly")
        if seed is not None:
            args += ["--seed", str(seed)]
        if netns is not None:
            args = ["ip", "netns", "exec", netns, *args]
        super().__init__(args, env=env, timeout=timeout)
        self.name: str = self.hello["name"]
        self.regions: dict[str, int] = self.hello["regions"]

    def sha256(self, region: str | int, offset: int, length: int) -> str:
        """Hex SHA-256 of a range of one of the peer's regions."""
        reply = self.call(
            {"cmd": "sha256", "region": self._region(region), "offset": offset, "length": length}
        )
        return str(reply["sha256"])

    def fill(self, region: str | int, seed: int) -> None:
        """Overwrite a region with :func:`pattern` of ``seed``."""
        self.call({"cmd": "fill", "region": self._region(region), "seed": seed})

    def fence(self, region: str) -> int:
        """Fence one of the peer's regions (``TransferEngine.fence``); returns the new id."""
        reply = self.call({"cmd": "fence", "region": self._region(region)})
        self.regions[region] = int(reply["region"])
        return self.regions[region]

    def transfer(
        self,
        op: str,
        segment: str,
        remote_region: int,
        ranges: Sequence[tuple[int, int, int]],
        *,
        region: str = "private",
        timeout: float = 10.0,
    ) -> list[str]:
        """Run a batch from the peer against ``segment``; ranges are (local, remote, length)."""
        reply = self.call(
            {
                "cmd": "transfer",
                "op": op,
                "segment": segment,
                "remote_region": remote_region,
                "ranges": [list(r) for r in ranges],
                "region": self._region(region),
                "timeout": timeout,
            }
        )
        return list(reply["statuses"])

    def _region(self, region: str | int) -> int:
        return self.regions[region] if isinstance(region, str) else region


# ------------------------------------------------------------------------------ child side


def _serve(engine: TransferEngine, regions: dict[int, MemoryRegion]) -> None:
    for line in sys.stdin:
        try:
            reply = _handle(engine, regions, json.loads(line))
        except (KVConnectError, KeyError, ValueError) as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


def _handle(
    engine: TransferEngine, regions: dict[int, MemoryRegion], command: dict[str, Any]
) -> dict[str, Any]:
    cmd = command["cmd"]
    if cmd == "sha256":
        region = regions[command["region"]]
        start = command["offset"]
        data = region.view[start : start + command["length"]]
        return {"sha256": hashlib.sha256(data).hexdigest()}
    if cmd == "fill":
        region = regions[command["region"]]
        region.view[:] = pattern(command["seed"], region.length).data
        return {"ok": True}
    if cmd == "transfer":
        local = regions[command["region"]]
        requests = [
            TransferRequest(local, lo, command["segment"], command["remote_region"], ro, n)
            for lo, ro, n in command["ranges"]
        ]
        batch = engine.submit(TransferOp(command["op"]), requests, timeout=command["timeout"])
        return {"statuses": [s.value for s in batch.wait()]}
    if cmd == "fence":
        fresh = engine.fence(regions.pop(command["region"]))
        regions[fresh.id] = fresh
        return {"region": fresh.id}
    if cmd == "stats":
        stats = engine.stats()
        reply = dataclasses.asdict(stats.listener)
        reply["transports"] = {k: dataclasses.asdict(v) for k, v in stats.transports.items()}
        return reply
    raise ValueError(f"unknown command {cmd!r}")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the child process."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="{}")
    parser.add_argument("--shared", type=int, default=0)
    parser.add_argument("--private", type=int, default=0)
    parser.add_argument("--shared-readonly", action="store_true")
    parser.add_argument("--seed", type=int)
    args = parser.parse_args(argv)
    config = TransferConfig.from_env(**json.loads(args.config))
    with TransferEngine(config) as engine:
        regions: dict[int, MemoryRegion] = {}
        names: dict[str, int] = {}
        if args.shared:
            region = engine.allocate(args.shared, writable=not args.shared_readonly)
            regions[region.id] = region
            names["shared"] = region.id
        if args.private:
            region = engine.register(np.zeros(args.private, dtype=np.uint8))
            regions[region.id] = region
            names["private"] = region.id
        if args.seed is not None:
            for offset, key in enumerate(("shared", "private")):
                if key in names:
                    region = regions[names[key]]
                    region.view[:] = pattern(args.seed + offset, region.length).data
        hello = {"name": engine.name, "pid": os.getpid(), "regions": names}
        print(json.dumps(hello), flush=True)
        _serve(engine, regions)


if __name__ == "__main__":
    main()
