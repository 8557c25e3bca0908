"""The store's programs (`kvconnect master|store|serve`), run for real in child processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvconnect.store.launch import Cluster

# Runs one program with its wait for a signal replaced by a report of the collector's frozen
# objects, taken once the program is serving.
_PROGRAM = """
import gc, sys
from kvconnect.store import commands
from kvconnect.store.config import MasterConfig, StoreServerConfig
from kvconnect.transfer import TransferConfig

commands.wait_for_signal = lambda failed=None: print("frozen", gc.get_freeze_count())
program, master = sys.argv[1], sys.argv[2]
store = StoreServerConfig(master=master, size=1 << 20)
if program == "master":
    commands.run_master(MasterConfig(listen="tcp://127.0.0.1:0"))
elif program == "store":
    commands.run_store(store, TransferConfig())
else:
    commands.run_serve(MasterConfig(listen="tcp://127.0.0.1:0"), store, TransferConfig())
"""


def _frozen(program: str, master: str = "") -> int:
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, program, master],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("frozen")]
    return int(line.split()[1])


@pytest.mark.parametrize("program", ["master", "serve"])
def test_a_serving_program_has_frozen_its_start_up_heap(program: str) -> None:
    # The imported modules alone are tens of thousands of objects; none frozen by default.
    assert _frozen(program) > 10_000


def test_a_serving_store_server_has_frozen_its_start_up_heap() -> None:
    with Cluster(servers=0) as cluster:
        assert _frozen("store", cluster.master_endpoint) > 10_000
