"""What ships: the wheel holds the library and no test support code, and the native extension
is optional (without a compiler, kvconnect installs and works in pure Python; the suite itself
runs with the extension built and required)."""

from __future__ import annotations

import os
import shutil
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


# The public test kit; everything else kvconnect's own tests use lives in tests/support/ or,
# when a shipped command needs it too, beside that command (kvconnect.store.launch, bench/).
TEST_KIT = {
    "kvconnect/testing/__init__.py",
    "kvconnect/testing/peer.py",
    "kvconnect/testing/conformance.py",
}
_NOT_SOURCE = (".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "*.so")
TESTS_ONLY = ("conftest.py", "store_worker.py", "prefill_peer.py", "fakes.py", "harness.py")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built without a C compiler (so without the extension; the
    rest of its contents does not depend on the compiler). Built from a copy of the source:
    setuptools would otherwise reuse (and ship) stale files of an earlier build/ here."""
    source = tmp_path_factory.mktemp("source") / "kvconnect"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    env = {**os.environ, "CC": "false", "KVCONNECT_REQUIRE_NATIVE": "0"}
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(source)],
        env=env,
        check=True,
        capture_output=True,
    )
    (built,) = wheels.glob("kvconnect-*.whl")
    return built


@pytest.mark.slow
def test_wheel_ships_the_library_and_no_test_support(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    code = {n for n in names if not n.startswith("kvconnect-")}  # without the .dist-info
    assert all(n.startswith("kvconnect/") for n in code), sorted(code)
    assert {n for n in code if n.startswith("kvconnect/testing/")} == TEST_KIT
    assert not [n for n in code if n.rsplit("/", 1)[-1] in TESTS_ONLY]
    assert {"kvconnect/py.typed", "kvconnect/_native.pyi", "kvconnect/cli.py"} <= code
    assert "kvconnect/bench/transfer.py" in code
    assert "kvconnect/bench/baselines/mooncake_runner.py" in code


@pytest.mark.slow
def test_install_without_compiler_falls_back_to_pure_python(wheel: Path, tmp_path: Path) -> None:
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
