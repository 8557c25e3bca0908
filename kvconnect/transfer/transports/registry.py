"""The transports an engine builds, most preferred first.

Adding a transport: write its module (a class implementing
:class:`~kvconnect.transfer.transports.base.Transport` and an ``ENTRY``), list the entry in
``_BUILTIN`` (or call :func:`register` from outside the package), and run the conformance suite
(:mod:`kvconnect.testing.conformance`) against it.
"""

from __future__ import annotations

import threading

from kvconnect.transfer.transports import local, shm, tcp
from kvconnect.transfer.transports.base import TransportEntry
from kvconnect.transfer.transports.rdma import transport as rdma

_BUILTIN = (local.ENTRY, shm.ENTRY, rdma.ENTRY, tcp.ENTRY)

_lock = threading.Lock()
_entries: list[TransportEntry] = list(_BUILTIN)


def entries() -> list[TransportEntry]:
    """The registered transports in order of preference (``auto`` routing tries them in turn).

    Engines build them in the reverse order, so each factory sees every less-preferred
    transport in ``TransportContext.built`` (RDMA hands work it cannot do to TCP).
    """
    with _lock:
        return list(_entries)


def register(entry: TransportEntry, *, before: str) -> None:
    """Add ``entry``, preferred just before the transport named ``before``.

    Engines started afterwards build it. Raises ValueError for a name already registered or
    an unknown ``before``.
    """
    with _lock:
        names = [e.name for e in _entries]
        if entry.name in names:
            raise ValueError(f"transport {entry.name!r} is already registered")
        if before not in names:
            raise ValueError(f"no transport {before!r} to register {entry.name!r} before")
        _entries.insert(names.index(before), entry)


def unregister(name: str) -> None:
    """Remove a transport added with :func:`register` (built-in ones stay)."""
    with _lock:
        _entries[:] = [e for e in _entries if e.name != name or e in _BUILTIN]
