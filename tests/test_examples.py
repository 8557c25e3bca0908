"""The example launch scripts stay runnable: valid shell, and kvconnect settings that parse."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from kvconnect.sglang.config import parse_config
from kvconnect.vllm.config import parse_config as parse_vllm_config

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
        assert parse_config(extra, {}).store.master.startswith(("tcp://", "etcd://"))


def test_vllm_settings_in_the_examples_parse() -> None:
    single = (EXAMPLES / "vllm" / "pd_single_host.sh").read_text()
    settings = [json.loads(s) for s in re.findall(r"^\s*EXTRA='(\{.*\})'$", single, re.M)]
    xpyd = EXAMPLES / "vllm" / "xpyd.sh"
    function = re.search(r"^extra\(\) \{.*?^\}", xpyd.read_text(), re.M | re.S)
    assert function is not None
    for pool in ("", "etcd://10.0.0.5:2379"):
        script = f"HOST_IP=10.0.0.7 POOL_MASTER={pool}\n{function.group(0)}\nextra"
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
        settings.append(json.loads(out.stdout))
    assert len(settings) == 4
    configs = [parse_vllm_config(extra, {}) for extra in settings]
    assert [c.pool for c in configs] == [False, True, False, True]
    assert configs[3].store.master == "etcd://10.0.0.5:2379"
    assert configs[2].host == "10.0.0.7"
