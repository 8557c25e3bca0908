"""The backend's settings, parsed once, from SGLang's ``--hicache-storage-backend-extra-config``.

Precedence, highest first: the extra-config JSON, then the JSON file it (or the environment)
names as ``config_file``, then ``KVCONNECT_SGLANG_*`` environment variables. Unknown keys are
errors that list the valid ones; the keys SGLang itself uses in the extra-config to load a
``dynamic`` backend are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvconnect.config import HiCacheConfig
from kvconnect.errors import ConfigError

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""Extra-config keys that belong to SGLang's ``dynamic`` backend loader."""


def parse_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> HiCacheConfig:
    """The backend's configuration; raises ConfigError for unknown keys or bad values."""
    inline = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
    path = inline.get("config_file") or HiCacheConfig.from_layers(environ=environ).config_file
    return HiCacheConfig.from_layers(_read_file(path), inline, environ=environ)


def _read_file(path: str) -> dict[str, Any]:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the kvconnect config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of settings")
    return data
