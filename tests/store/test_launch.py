"""Helpers that start kvconnect processes (kvconnect/store/launch.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconnect.store import launch


def test_free_port_never_gives_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may hand the same free port to two probes in a row; two servers told to bind
    it would race for it (a router test's KV-events ports once did)."""
    kernel: Iterator[int] = iter([40001, 40001, 40001, 40002])

    class Probe:  # the kernel's answers, in order
        def __enter__(self) -> Probe:
            self.port = next(kernel)
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            assert address == ("127.0.0.1", 0)

        def getsockname(self) -> tuple[str, int]:
            return "127.0.0.1", self.port

    monkeypatch.setattr(launch, "_GIVEN", set())
    monkeypatch.setattr(launch.socket, "socket", Probe)
    assert [launch.free_port(), launch.free_port()] == [40001, 40002]
