"""The example launch scripts stay runnable: valid shell, and kvconnect settings that parse."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from kvconnect.sglang.config import parse_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(EXAMPLES.rglob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_scripts_are_valid_shell(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", sorted((EXAMPLES / "sglang").glob("*.sh")))
def test_sglang_settings_in_the_examples_parse(script: Path) -> None:
    text = script.read_text().replace('\\"', '"').replace("$ETCD", "etcd://e1:2379")
    text = text.replace("$HOST_IP", "10.0.0.7")
    configs = re.findall(r"'(\{\".*?\})'|\"(\{\".*?\})\"\s*$", text, flags=re.MULTILINE)
    settings = [json.loads(a or b) for a, b in configs]
    assert settings, f"{script.name} passes no kvconnect settings"
    for extra in settings:
        assert parse_config(extra, {}).master.startswith(("tcp://", "etcd://"))
