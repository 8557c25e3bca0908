"""The launch scripts of examples/sglang/ use only what SGLang 0.5.23 and kvconnect accept.

Each script runs for real under bash with stand-ins for the programs it starts (``python``,
``sglang``, ``kvconnect``, ...) that record their argv, so its variables are expanded as the
script expands them. The recorded SGLang command line is then parsed by SGLang's own argument
parser with kvconnect's plugin loaded and resolved by SGLang's resolution pipeline (the
plugin-dependent rewrites included), and its extra-config by kvconnect's parser.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sglang.srt.server_args import prepare_server_args

from kvconnect.bench.tiny_llama import write_tiny_llama
from kvconnect.sglang.config import parse_config

pytestmark = [pytest.mark.sglang]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sglang"
HOST_IP = "10.0.0.5"
SCRIPT_TIMEOUT = 30.0

# A recording stand-in: one file per call, the program's name and its argv, NUL-separated.
# A program the script runs in the background (a store) stays up until the script kills it;
# the kill may come at any moment, so a record appears whole (renamed) or not at all.
_STUB = """#!/bin/sh
part=$(mktemp "$STUB_CALLS/part.XXXXXX")
printf '%s\\0' "$(basename "$0")" "$@" > "$part"
mv "$part" "$STUB_CALLS/call.${part##*.}"
if [ "$(basename "$0")" = kvconnect ]; then exec sleep 600; fi
"""
_PROGRAMS = ("python", "python3", "sglang", "kvconnect")


@dataclass(frozen=True)
class Example:
    """A script, its arguments, and the settings it means SGLang and kvconnect to run with."""

    script: str
    args: tuple[str, ...]
    hicache: dict[str, Any]  # resolved SGLang fields
    kvconnect: dict[str, Any]  # kvconnect settings from the extra-config, by attribute path
    tp_size: int = 1


EXAMPLE_INTENTS = [
    Example(
        "single_node.sh",
        (),
        {
            "hicache_storage_backend": "kvconnect",
            "hicache_mem_layout": "page_first",
            "hicache_ratio": 2.0,
            "hicache_write_policy": "write_through",
            "hicache_storage_prefetch_policy": "timeout",
        },
        {"store.master": "tcp://127.0.0.1:50051"},
    ),
    Example(
        "dynamic_route.sh",
        (),
        {"hicache_storage_backend": "dynamic", "hicache_mem_layout": "page_first"},
        {"store.master": "tcp://127.0.0.1:50051"},
    ),
    Example(
        "multi_node.sh",
        ("engine",),
        {
            "hicache_storage_backend": "kvconnect",
            "hicache_mem_layout": "page_first",
            "hicache_ratio": 2.0,
        },
        {
            "store.master": "etcd://e1:2379,e2:2379,e3:2379",
            "transfer.listen_host": HOST_IP,
        },
        tp_size=8,
    ),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny local model for the scripts' ``$MODEL``: SGLang's resolution reads its config."""
    return write_tiny_llama(tmp_path_factory.mktemp("model"), weights=False)


def test_every_script_is_covered() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.sh")) == sorted(
        e.script for e in EXAMPLE_INTENTS
    )


@pytest.mark.parametrize("example", EXAMPLE_INTENTS, ids=lambda e: e.script)
def test_the_script_launches_sglang_with_flags_it_accepts(
    example: Example, plugins_loaded: None, model: Path, tmp_path: Path
) -> None:
    argv = _sglang_command(example, model, tmp_path)
    # No GPU here: SGLang resolves the same flags for a CPU device.
    args = prepare_server_args([*argv, "--device", "cpu"])
    args.resolve_once()
    resolved = args.resolved_dict()
    assert {key: resolved[key] for key in example.hicache} == example.hicache
    assert resolved["enable_hierarchical_cache"] is True
    assert resolved["tp_size"] == example.tp_size
    assert resolved["model_path"] == str(model), "the script passes $MODEL"
    config = parse_config(json.loads(resolved["hicache_storage_backend_extra_config"]))
    for path, expected in example.kvconnect.items():
        section, name = path.split(".")
        assert getattr(getattr(config, section), name) == expected, path


def _sglang_command(example: Example, model: Path, tmp_path: Path) -> list[str]:
    """The arguments of the one SGLang launch the script makes (after
    ``python -m sglang.launch_server`` or ``sglang serve``)."""
    calls = tmp_path / "calls"
    calls.mkdir()
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for program in _PROGRAMS:
        stub = stubs / program
        stub.write_text(_STUB)
        stub.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "STUB_CALLS": str(calls),
        "MODEL": str(model),
        "HOST_IP": HOST_IP,
    }
    script = EXAMPLES / example.script
    subprocess.run(
        ["bash", str(script), *example.args],
        env=env,
        check=True,
        timeout=SCRIPT_TIMEOUT,
        capture_output=True,
    )
    launches = []
    for record in calls.glob("call.*"):
        program, *argv = record.read_bytes().decode().split("\0")[:-1]
        if program.startswith("python") and argv[:2] == ["-m", "sglang.launch_server"]:
            launches.append(argv[2:])
        elif program == "sglang" and argv[:1] == ["serve"]:
            launches.append(argv[1:])
    assert len(launches) == 1, f"{example.script} launches SGLang {len(launches)} times"
    return launches[0]
