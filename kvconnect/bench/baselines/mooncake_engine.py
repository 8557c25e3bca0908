"""Mooncake's TCP transfer engine in two processes of an interpreter with the ``mooncake``
package (``mooncake_runner.py``), a baseline of the tcp transport."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path


class MooncakeBaseline:
    """Mooncake's TCP transfer engine, two processes, through mooncake_runner.py."""

    name = "mooncake"

    def __init__(self, python: str, buffer_bytes: int) -> None:
        runner = Path(__file__).with_name("mooncake_runner.py")
        self._proc = subprocess.Popen(
            [python, str(runner), "--buffer", str(buffer_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self._read().get("ready") is not True:
            raise RuntimeError("mooncake runner did not start")

    def run(self, op: str, block: int, count: int, batches: int) -> list[float]:
        assert self._proc.stdin is not None
        command = {"op": op, "block": block, "count": count, "batches": batches}
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        seconds = self._read()["seconds"]
        assert isinstance(seconds, list)
        return [float(s) for s in seconds]

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def _read(self) -> dict[str, object]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"mooncake runner exited ({self._proc.wait(timeout=30)})")
        reply: dict[str, object] = json.loads(line)
        return reply


def find_mooncake_python(explicit: str | None) -> str | None:
    """An interpreter that can import ``mooncake``: ``explicit``, or this one, or None."""
    if explicit:
        return explicit
    return sys.executable if importlib.util.find_spec("mooncake") is not None else None
