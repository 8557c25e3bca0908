"""The backend's settings, parsed once, from SGLang's ``--hicache-storage-backend-extra-config``.

Precedence, highest first: the extra-config JSON, then the JSON file it (or the environment)
names as ``config_file``, then ``KVCONNECT_SGLANG_*`` environment variables. Unknown keys are
errors that list the valid ones; the keys SGLang itself uses in the extra-config to load a
``dynamic`` backend are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvconnect.config import HiCacheConfig, engine_config

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""Extra-config keys that belong to SGLang's ``dynamic`` backend loader."""


def parse_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> HiCacheConfig:
    """The backend's configuration; raises ConfigError for unknown keys or bad values."""
    inline = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
    return engine_config(HiCacheConfig, inline, environ)
