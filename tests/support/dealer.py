"""The ``raw_dealer`` fixture's type (the fixture itself is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

import zmq

RawDealer = Callable[[str, "str | None", str], "zmq.Socket[bytes]"]
