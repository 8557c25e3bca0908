"""vLLM's NixlConnector (NIXL over UCX/TCP), the baseline of ``kvconnect bench vllm``: how a
prefill or decode server is configured to use it."""

from __future__ import annotations

from pathlib import Path

_UNPINNED = """# written by kvconnect bench vllm --nixl-pinning off
import os, sys
_setaffinity = os.sched_setaffinity

def _skip_nixl_pinning(pid, cpus):
    if "nixl" in sys._getframe(1).f_code.co_filename:  # vLLM's NixlConnector worker
        return
    _setaffinity(pid, cpus)

os.sched_setaffinity = _skip_nixl_pinning
"""


def _unpinned_site(work: Path) -> Path:
    """A directory whose ``sitecustomize`` (imported by every process of the server, workers
    included) makes vLLM's NixlConnector leave its worker's CPU affinity alone."""
    site = work / "nixl-unpinned"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_UNPINNED)
    return site


def connector(work: Path, *, pinned: bool) -> tuple[dict[str, str], dict[str, str]]:
    """The ``kv_transfer_config`` entries (without the role) and the environment of a vLLM
    server using NIXL. ``pinned``: as shipped (on CPU, NixlConnector pins each worker's main
    thread); otherwise that call is skipped through a ``sitecustomize`` under ``work``."""
    config = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    env = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}  # UCX over TCP, no shm
    if not pinned:
        env["PYTHONPATH"] = str(_unpinned_site(work))
    return config, env
