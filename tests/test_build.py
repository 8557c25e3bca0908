"""The native extension is optional: without a compiler, kvconnect installs and works in pure
Python. (The suite itself runs with the extension built and required.)"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import numpy as np
from kvconnect import TransferConfig, TransferEngine
from kvconnect.transfer.datapath.iov import native_available
assert not native_available(), "the extension should not exist in this install"
with TransferEngine(TransferConfig(native="auto")) as a, TransferEngine() as b:
    remote = b.allocate(1 << 20)
    remote.view[:] = bytes(range(256)) * 4096
    local = a.register(np.zeros(1 << 20, dtype=np.uint8))
    a.read(local, 0, b.name, remote.id, 0, 1 << 20)
    assert local.view == remote.view
print("pure-python-ok")
"""


@pytest.mark.slow
def test_install_without_compiler_falls_back_to_pure_python(tmp_path: Path) -> None:
    env = {**os.environ, "CC": "false", "KVCONNECT_REQUIRE_NATIVE": "0"}
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        env=env,
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("kvconnect-*.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    # -S: skip site.py, so the editable install of this checkout (a .pth hook) stays out;
    # dependencies still come from this environment's site-packages, after the new install.
    path = os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])
    out = subprocess.run(
        [sys.executable, "-S", "-c", CHECK],
        env={**os.environ, "PYTHONPATH": path},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "pure-python-ok"
