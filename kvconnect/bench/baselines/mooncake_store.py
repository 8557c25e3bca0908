"""Mooncake Store in child processes of an interpreter with the ``mooncake`` package
(``mooncake_store_runner.py``: its own master and store server), the baseline of
``kvconnect bench store``. Commands and replies are JSON lines."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_RUNNER = Path(__file__).with_name("mooncake_store_runner.py")


class MooncakeStoreBaseline:
    """Mooncake Store through mooncake_store_runner.py (its own master and store server)."""

    def __init__(
        self, python: str, mode: str, segment: int, buffer: int, extra: Sequence[str] = ()
    ) -> None:
        """``python``: an interpreter with ``mooncake``; ``mode`` as kvconnect's (``tcp`` or
        ``same-host``); ``segment``: the store's memory; ``buffer``: the client's buffer;
        ``extra``: more runner options (``--offload DIR``)."""
        self.proc = subprocess.Popen(
            [
                python,
                str(_RUNNER),
                "--mode",
                mode,
                "--segment",
                str(segment),
                "--buffer",
                str(buffer),
                *extra,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if not self._read().get("ready"):
            raise RuntimeError("mooncake store runner did not start")

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("mooncake store runner exited")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"mooncake: {reply['error']}")
        return reply

    def run(self, command: dict[str, Any]) -> list[float]:
        seconds = [float(s) for s in self.call(command)["seconds"]]
        self.call({"op": "remove_all"})
        return seconds

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextmanager
def store_servers(python: str, segment: int, holders: int) -> Iterator[dict[str, Any]]:
    """Mooncake's master (with its HTTP metadata server) and ``holders`` store processes of
    ``segment`` bytes each, run by ``python`` (an interpreter with ``mooncake``), for clients
    in other processes; yields the runner's ready line (``master``: the master's address,
    ``metadata``: the metadata server's URL)."""
    argv = [python, str(_RUNNER), "--role", "servers", "--holders", str(holders)]
    proc = subprocess.Popen(
        [*argv, "--segment", str(segment)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        reply: dict[str, Any] = json.loads(proc.stdout.readline() or '{"ready": false}')
        if not reply.get("ready"):
            raise RuntimeError(f"mooncake servers did not start (rc={proc.poll()})")
        yield reply
    finally:
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        proc.wait(timeout=60)
