"""The backend's settings, parsed once, from SGLang's ``--hicache-storage-backend-extra-config``.

Precedence, highest first: the extra-config JSON, then the JSON file it (or the environment)
names as ``config_file``, then ``KVCONNECT_SGLANG_*`` environment variables. The extra-config
is shared with SGLang: the keys SGLang itself reads there are accepted and left to SGLang; any
other key that is not a kvconnect setting is an error listing the valid ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvconnect.config import HiCacheConfig, engine_config
from kvconnect.errors import ConfigError

SGLANG_KEYS = frozenset(
    {
        # the ``dynamic`` backend loader (storage/backend_factory.py, cache_controller.py)
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        # the controller's prefetch settings; SGLang pops them before building the backend
        # on most paths, but not all (the PD decode offload manager passes the JSON as is)
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
        # added by SGLang from --file-storage-path (unified_radix_cache.py), for every backend
        "file_storage_path",
    }
)
"""Extra-config keys SGLang 0.5.23 reads (or writes) itself, whatever the backend."""

_SETTINGS = frozenset(f.name for f in dataclasses.fields(HiCacheConfig))


def parse_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> HiCacheConfig:
    """The backend's configuration; raises ConfigError for unknown keys or bad values."""
    extra = extra or {}
    unknown = sorted(set(extra) - _SETTINGS - SGLANG_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)} in --hicache-storage-backend-extra-config; "
            f"valid: kvconnect's {', '.join(sorted(_SETTINGS))}, and SGLang's own "
            f"{', '.join(sorted(SGLANG_KEYS))}"
        )
    inline = {k: v for k, v in extra.items() if k not in SGLANG_KEYS}
    return engine_config(HiCacheConfig, inline, environ)
