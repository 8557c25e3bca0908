"""SGLang tests run in SGLang's own environment (``./dev.sh test`` builds it).

Elsewhere the tests that need SGLang skip; with ``KVCONNECT_REQUIRE_SGLANG=1`` (set by
``./dev.sh test`` for that environment) a missing SGLang is an error instead.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None

if os.environ.get("KVCONNECT_REQUIRE_SGLANG") == "1" and not HAVE_SGLANG:
    raise RuntimeError("KVCONNECT_REQUIRE_SGLANG=1 but SGLang is not importable here")

if HAVE_SGLANG:
    # SGLang writes JIT builds (the page-hash extension) and caches under $HOME by default.
    _cache = os.path.join(
        os.environ.get("KVCONNECT_CACHE", os.path.expanduser("~/.cache/kvconnect")), "sglang-home"
    )
    for _var, _sub in (
        ("TORCH_EXTENSIONS_DIR", "torch_extensions"),
        ("SGLANG_CACHE_DIR", "sglang"),
        ("TRITON_CACHE_DIR", "triton"),
        ("TORCHINDUCTOR_CACHE_DIR", "torchinductor"),
    ):
        os.environ.setdefault(_var, os.path.join(_cache, _sub))
    with warnings.catch_warnings():
        # Importing SGLang on a CPU-only machine warns about GPU kernels it cannot use.
        warnings.simplefilter("ignore")
        from sglang.srt.runtime_context import get_parallel

        # One process plays one rank: the controller's collectives become no-ops.
        get_parallel().override_permanently(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
        )
        import sglang.srt.managers.cache_controller
        import sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller  # noqa: F401


@pytest.fixture(scope="session")
def plugins_loaded() -> None:
    """What SGLang does first in every process: run the installed plugins (kvconnect's only;
    its hooks then stay for the session, as in an SGLang process)."""
    from sglang.srt.plugins import load_plugins

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SGLANG_PLUGINS", "kvconnect")
        load_plugins()


# Without SGLang only the pure tests (keys, configuration, the deadline arithmetic) and the GPU
# test's skip are collected; every other module here needs SGLang.
_WITHOUT_SGLANG = {
    "__init__.py",
    "conftest.py",
    "test_budget.py",
    "test_config.py",
    "test_gpu_server.py",
    "test_keys.py",
}
collect_ignore = (
    []
    if HAVE_SGLANG
    else sorted(p.name for p in Path(__file__).parent.glob("*.py") if p.name not in _WITHOUT_SGLANG)
)
