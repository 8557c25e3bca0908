"""Mooncake Store in child processes of an interpreter with the ``mooncake`` package
(``mooncake_store_runner.py``: its own master and store server), the baseline of
``kvconnect bench store``. Commands and replies are JSON lines."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


class MooncakeStoreBaseline:
    """Mooncake Store through mooncake_store_runner.py (its own master and store server)."""

    def __init__(self, python: str, mode: str, segment: int, buffer: int) -> None:
        """``python``: an interpreter with ``mooncake``; ``mode`` as kvconnect's (``tcp`` or
        ``same-host``); ``segment``: the store's memory; ``buffer``: the client's buffer."""
        runner = Path(__file__).with_name("mooncake_store_runner.py")
        self.proc = subprocess.Popen(
            [
                python,
                str(runner),
                "--mode",
                mode,
                "--segment",
                str(segment),
                "--buffer",
                str(buffer),
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
