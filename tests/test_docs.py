"""Docs stay true to the code: every config field is documented with its real default."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvconnect._config import embedded_sections
from kvconnect.p2p import P2PConfig
from kvconnect.sglang.config import HiCacheConfig
from kvconnect.store.config import (
    MasterConfig,
    PeerConfig,
    StoreClientConfig,
    StoreServerConfig,
    TenantConfig,
)
from kvconnect.transfer import TransferConfig
from kvconnect.vllm.config import LoaderConfig, VllmConnectorConfig

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
        P2PConfig,
        LoaderConfig,
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
    embedded = embedded_sections(cls)
    for name, section_cls in embedded.items():
        assert rows.get(name) == "—", f"{cls.__name__}.{name} is missing from the docs"
        assert f"`{section_cls.__name__}`" in section
    flat = [(f.name, f.default) for f in dataclasses.fields(cls) if f.name not in embedded]
    flat += [(key, route.default) for key, route in getattr(cls, "_ROUTES", {}).items()]
    for name, default in flat:
        assert name in rows, f"{cls.__name__}.{name} is missing from the docs"
        assert f"{cls._ENV_PREFIX}{name.upper()}" in section
        shown = str(default).lower() if isinstance(default, bool) else str(default)
        assert rows[name] == shown, f"{name}: docs say {rows[name]}, code {shown}"


@pytest.mark.parametrize(
    ("cls", "required"), [(PeerConfig, ("name", "master")), (TenantConfig, ("name",))]
)
def test_configuration_reference_lists_every_item_key_with_its_default(
    cls: type, required: tuple[str, ...]
) -> None:
    text = (DOCS / "configuration.md").read_text()
    section = text.split(f"## `{cls.__name__}`", 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split("|")[1].strip().strip("`"): line.split("|")[2].strip().strip("`")
        for line in section.splitlines()
        if line.startswith("| `")
    }
    for field in dataclasses.fields(cls):
        assert field.name in rows, f"{cls.__name__}.{field.name} is missing from the docs"
        if field.name not in required:
            default = field.default
            shown = str(default).lower() if isinstance(default, bool) else str(default)
            assert rows[field.name] == shown, f"{field.name}: docs {rows[field.name]}, code {shown}"
