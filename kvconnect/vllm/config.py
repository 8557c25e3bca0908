"""The connector's settings, parsed once, from vLLM's ``kv_connector_extra_config``.

Precedence, highest first: the extra-config, then the JSON file it (or the environment) names
as ``config_file``, then ``KVCONNECT_VLLM_*`` environment variables. Unknown keys are errors
that list the valid ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvconnect.config import VllmConnectorConfig, engine_config


def parse_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> VllmConnectorConfig:
    """The connector's configuration; raises ConfigError for unknown keys or bad values."""
    return engine_config(VllmConnectorConfig, dict(extra or {}), environ)
