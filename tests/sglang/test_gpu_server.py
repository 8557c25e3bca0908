"""End to end on a GPU: a real SGLang server with kvconnect as its L3, restarted.

A long prompt is served once (write-through: its pages go GPU → host → kvconnect), the SGLang
instance is stopped and started again (the kvconnect cluster lives on), and the same prompt is
served again: the new instance has empty GPU and host caches, so its cached prefix can only
come from L3. Checks SGLang's own ``cached_tokens``, kvconnect's series on SGLang's
``/metrics``, and that greedy output is unchanged. Skipped without a CUDA device (and outside
SGLang's environment).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvconnect.bench.tiny_llama import VOCAB, write_tiny_llama
from kvconnect.store.launch import Cluster, free_port
from tests.support.child import child_env
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.sglang]

PAGE = 64  # SGLang's --page-size: the unit kvconnect stores
PROMPT_PAGES = 32
STARTUP = 600.0  # model load, CUDA graphs off, HiCache host pool
REQUEST_TIMEOUT = 120.0


def server_flags(model: Path, master: str, port: int) -> list[str]:
    """The server's flags: HiCache with kvconnect's literal backend name (the plugin), every
    prefetch completed before admission (``wait_complete``: the hit is all of L3's pages),
    metrics on, a small KV pool for a tiny model."""
    return [
        "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--page-size", str(PAGE), "--max-total-tokens", "8192",
        "--disable-cuda-graph", "--random-seed", "0", "--enable-metrics",
        "--enable-hierarchical-cache", "--hicache-ratio", "2",
        "--hicache-mem-layout", "page_first", "--hicache-write-policy", "write_through",
        "--hicache-storage-backend", "kvconnect",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps({"master": master}),
    ]  # fmt: skip


class SGLangServer:
    """``python -m sglang.launch_server`` with :func:`server_flags`, in its own process
    group."""

    def __init__(self, model: Path, master: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            *server_flags(model, master, self.port),
        ]
        env = {**child_env(), "HF_HUB_OFFLINE": "1", "SGLANG_PLUGINS": "kvconnect"}
        with log.open("w") as out:
            self.process = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_ready(self) -> None:
        """Until ``/health`` answers 200 (SGLang answers 503 while it starts)."""

        def ready() -> bool:
            assert self.process.poll() is None, f"SGLang exited:\n{self.tail()}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    return bool(reply.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        wait_for(ready, f"SGLang not ready in {STARTUP} s", STARTUP)

    def generate(self, input_ids: list[int]) -> dict[str, Any]:
        """A greedy ``/generate`` of 16 tokens."""
        body = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0.0},
        }
        request = urllib.request.Request(
            self.url + "/generate",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as reply:
            result: dict[str, Any] = json.load(reply)
        return result

    def metric(self, name: str) -> float:
        """The sum over every label set of ``name`` on SGLang's ``/metrics``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        )

    def stop(self) -> None:
        """SIGTERM to the whole group (the scheduler and detokenizer processes too)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    pytest.importorskip("sglang")
    with Cluster(servers=1, server_size=512 << 20) as c:
        yield c


def test_the_server_flags_are_ones_sglang_accepts(tmp_path: Path) -> None:
    # Here too, without a GPU: SGLang's own parser and resolution (the plugin loaded), for a
    # CPU device, so the GPU test cannot rot unnoticed.
    pytest.importorskip("sglang")
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SGLANG_PLUGINS", "kvconnect")
        load_plugins()
    model = write_tiny_llama(tmp_path / "model", weights=False)
    args = prepare_server_args([*server_flags(model, "tcp://127.0.0.1:1", 1), "--device", "cpu"])
    args.resolve_once()
    resolved = args.resolved_dict()
    assert resolved["hicache_storage_backend"] == "kvconnect"
    assert resolved["hicache_storage_prefetch_policy"] == "wait_complete"
    assert resolved["page_size"] == PAGE
    assert resolved["enable_metrics"] is True


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.integration
def test_a_restarted_instance_loads_the_prompt_from_l3(cluster: Cluster, tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "model")
    prompt = [3 + (i * 7) % (VOCAB - 3) for i in range(PROMPT_PAGES * PAGE + 10)]
    first_server = SGLangServer(model, cluster.master_endpoint, tmp_path / "first.log")
    try:
        first_server.wait_ready()
        first_server.generate(prompt)
        # The reference output is the cached one: computed over a cached prefix, as the
        # restarted instance computes it (bf16 kernels differ between full and extend prefill).
        reference = first_server.generate(prompt)
        assert reference["meta_info"]["cached_tokens"] >= (PROMPT_PAGES - 1) * PAGE
        # write-through: every full page of the prompt reaches L3 (K and V objects each)
        wait_for(
            lambda: cluster.stats().keys >= 2 * (PROMPT_PAGES - 1),
            "the prompt's pages did not reach kvconnect",
            60,
        )
    finally:
        first_server.stop()
    second_server = SGLangServer(model, cluster.master_endpoint, tmp_path / "second.log")
    try:
        second_server.wait_ready()
        second = second_server.generate(prompt)
        # A new instance has nothing cached of its own: only L3 can have given the prefix.
        assert second["meta_info"]["cached_tokens"] >= (PROMPT_PAGES - 1) * PAGE
        assert second_server.metric("kvconnect_hicache_pages_hit_total") >= PROMPT_PAGES - 1
        assert second["text"] == reference["text"]
    finally:
        second_server.stop()
