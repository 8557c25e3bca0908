"""``vllm serve MODEL --load-format kvconnect``: the checkpoint's weights from the P2P store.

The worker fetches the object named in ``--model-loader-extra-config`` (``{"etcd": …,
"name": …}``, :class:`~kvconnect.vllm.config.LoaderConfig`) from every node that holds part
of it into a local directory, then reads its safetensors files with the ``safetensors``
package; vLLM's own loading (weight names, sharding, post-processing) is unchanged. MODEL is
still a local directory with the model's config and tokenizer (vLLM reads them before any
loader runs). When the swarm cannot deliver, the load falls back to MODEL's own files (unless
``fallback`` is false). The worker keeps serving the weights to instances that start later
until it exits (``seed``).

Registered by :func:`register`, vLLM's ``vllm.general_plugins`` entry point, which runs in
every vLLM process (the loader runs in the worker).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvconnect.errors import KVConnectError, P2PError
from kvconnect.p2p import Files, P2PNode
from kvconnect.vllm.config import LoaderConfig, parse_loader_config

log = logging.getLogger(__name__)

LOAD_FORMAT = "kvconnect"

_seeders: list[P2PNode] = []  # nodes that keep serving fetched weights until exit
_seeders_lock = threading.Lock()


def register() -> None:
    """vLLM's general-plugin hook: make ``--load-format kvconnect`` known in this process.
    Never raises (vLLM lets a plugin's exception end the process): a failure is logged and
    the load format stays unknown."""
    try:
        from vllm.model_executor.model_loader import register_model_loader

        register_model_loader(LOAD_FORMAT)(_loader_class())
    except Exception:
        log.exception("kvconnect: --load-format %s is not available", LOAD_FORMAT)


def fetch_weights(config: LoaderConfig) -> Path | None:
    """Fetch the object into ``config.target()``; its directory, or None after a failure
    when ``fallback`` is set (raises the failure otherwise). Blocks up to ``timeout``.

    The workers of one host (tensor parallel) share the directory: one fetches while the
    others wait on its lock, then find the files complete (verified, not fetched again)."""
    node = P2PNode(config.p2p)
    target = config.target()
    deadline = time.monotonic() + config.timeout
    try:
        with _directory_lock(target, deadline):
            node.start()
            manifest, stats = node.fetch(
                config.name,
                Files(target),
                config.version or None,
                timeout=max(deadline - time.monotonic(), 1e-3),
            )
    except (KVConnectError, OSError) as exc:
        node.close()
        if not config.fallback:
            raise
        log.warning("kvconnect: cannot fetch %s (%s): loading the local files", config.name, exc)
        return None
    log.info(
        "kvconnect: %s version %s in %s: fetched %d bytes from %d holders, %d chunks were here",
        manifest.name,
        manifest.version,
        target,
        stats.fetched_bytes,
        len(stats.by_holder),
        stats.reused,
    )
    if config.seed:
        with _seeders_lock:
            if not _seeders:
                atexit.register(_close_seeders)
            _seeders.append(node)
    else:
        node.close()
    return target


@contextlib.contextmanager
def _directory_lock(target: Path, deadline: float) -> Iterator[None]:
    """An exclusive lock on ``target`` (a file in it) until the block ends; P2PError if
    another process holds it past ``deadline``."""
    target.mkdir(parents=True, exist_ok=True)
    fd = os.open(target / ".kvconnect-p2p.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise P2PError(f"{target} stayed locked by another fetch") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def safetensors_weights(directory: Path) -> Iterator[tuple[str, Any]]:
    """Every tensor of every ``*.safetensors`` file under ``directory`` (sorted by path)."""
    from safetensors import safe_open

    for path in sorted(directory.rglob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not a mapping
                yield name, handle.get_tensor(name)


def _close_seeders() -> None:
    with _seeders_lock:
        nodes, _seeders[:] = list(_seeders), []
    for node in nodes:
        node.close()


def _loader_class() -> type:
    from vllm.model_executor.model_loader import DefaultModelLoader

    class KVConnectModelLoader(DefaultModelLoader):  # type: ignore[misc]
        """vLLM's safetensors loading, with the files from the P2P store."""

        def __init__(self, load_config: Any) -> None:
            self.kvconnect = parse_loader_config(load_config.model_loader_extra_config)
            self._directory: Path | None = None
            self._fetched = False
            # The parent validates its own format and extra-config: give it the local one.
            plain = dataclasses.replace(
                load_config, load_format="safetensors", model_loader_extra_config={}
            )
            super().__init__(plain)

        def download_model(self, model_config: Any) -> None:
            self._weights()

        def get_all_weights(self, model_config: Any, model: Any) -> Iterator[tuple[str, Any]]:
            directory = self._weights()
            if directory is None:
                yield from super().get_all_weights(model_config, model)
                return
            yield from safetensors_weights(directory)

        def _weights(self) -> Path | None:
            if not self._fetched:
                self._directory = fetch_weights(self.kvconnect)
                self._fetched = True
            return self._directory

    return KVConnectModelLoader
