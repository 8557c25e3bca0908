"""Docs stay true to the code: every config field is documented with its real default."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvconnect.config import TransferConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_configuration_reference_lists_every_field_with_its_default() -> None:
    text = (DOCS / "configuration.md").read_text()
    rows = {
        line.split("|")[1].strip().strip("`"): line.split("|")[3].strip().strip("`")
        for line in text.splitlines()
        if line.startswith("| `")
    }
    for field in dataclasses.fields(TransferConfig):
        assert field.name in rows, f"{field.name} is missing from docs/configuration.md"
        assert f"KVCONNECT_TRANSFER_{field.name.upper()}" in text
        default = field.default
        shown = str(default).lower() if isinstance(default, bool) else str(default)
        assert rows[field.name] == shown, f"{field.name}: docs say {rows[field.name]}, code {shown}"
