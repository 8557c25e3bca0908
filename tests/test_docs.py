"""Docs stay true to the code: every config field is documented with its real default."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvconnect.config import (
    HiCacheConfig,
    MasterConfig,
    StoreClientConfig,
    StoreServerConfig,
    TransferConfig,
    VllmConnectorConfig,
)

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize(
    "cls",
    [
        TransferConfig,
        MasterConfig,
        StoreServerConfig,
        StoreClientConfig,
        HiCacheConfig,
        VllmConnectorConfig,
    ],
)
def test_configuration_reference_lists_every_field_with_its_default(cls: type) -> None:
    text = (DOCS / "configuration.md").read_text()
    section = text.split(f"## `{cls.__name__}`", 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split("|")[1].strip().strip("`"): line.split("|")[3].strip().strip("`")
        for line in section.splitlines()
        if line.startswith("| `")
    }
    for field in dataclasses.fields(cls):
        assert field.name in rows, f"{cls.__name__}.{field.name} is missing from the docs"
        assert f"{cls._ENV_PREFIX}{field.name.upper()}" in section
        default = field.default
        shown = str(default).lower() if isinstance(default, bool) else str(default)
        assert rows[field.name] == shown, f"{field.name}: docs say {rows[field.name]}, code {shown}"
