"""SGLang HiCache L3 storage backend (``--hicache-storage-backend kvconnect``).

``KVConnectStore`` (kvconnect/sglang/backend.py) imports SGLang and torch; this package does
not, so importing it (as SGLang's plugin loader does in every process) costs nothing until
the backend is built.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVConnectStore"]


def __getattr__(name: str) -> Any:
    # Lazy: ``module_path: "kvconnect.sglang"`` works for SGLang's dynamic loader.
    if name == "KVConnectStore":
        from kvconnect.sglang.backend import KVConnectStore

        return KVConnectStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
