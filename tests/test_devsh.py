"""``./dev.sh test`` with fake environments: what it runs, and that a failed install fails it.

The environments under ``KVCONNECT_CACHE`` and the Soft-RoCE VM under ``KVCONNECT_SHARED`` are
stand-ins that record each call (nothing is installed or tested for real); ``dpkg`` on ``PATH``
says every Debian package is there.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENVIRONMENTS = ("venv", "sglang-venv", "vllm-venv", "vllm-cpu-venv")

_RECORD = 'printf "%s %s\\n" "${0#"$FAKE_ROOT"/}" "$*" >>"$FAKE_LOG"\n'
_PIP = (
    _RECORD
    + 'echo "require_native=${KVCONNECT_REQUIRE_NATIVE:-}" >>"$FAKE_LOG"\n'
    + "echo \"WARNING: Location 'https://mirror/simple/x/' is ignored\" >&2\n"
    + 'case "$0" in *"/${FAKE_PIP_FAIL:-none}/"*) echo "ERROR: No matching distribution" >&2; '
    + "exit 1 ;; esac\n"
)
# import and version checks pass, pytest runs "pass" (and records what it is required to find)
_PYTHON = _RECORD + (
    'case "$*" in "-m pytest"*) echo "${0#"$FAKE_ROOT"/} requires" '
    '$(env | grep -o "^KVCONNECT_REQUIRE_[A-Z_]*=1" | sort) >>"$FAKE_LOG" ;; esac\n'
)


@dataclass
class Run:
    code: int
    output: str
    calls: list[str]

    def pytest_runs(self, environment: str) -> list[str]:
        """The arguments of each pytest run in ``environment``."""
        command = f"cache/{environment}/bin/python -m pytest"
        return [
            call.removeprefix(command).strip()
            for call in self.calls
            if call == command or call.startswith(command + " ")
        ]

    def requires(self, environment: str) -> list[str]:
        """The ``KVCONNECT_REQUIRE_*`` variables set to 1 of each pytest run in
        ``environment``."""
        prefix = f"cache/{environment}/bin/python requires"
        return [c.removeprefix(prefix).strip() for c in self.calls if c.startswith(prefix)]

    def vm_runs(self) -> list[str]:
        """The pytest arguments of each run in the RDMA VM."""
        marker = "-m rdma "
        return [c.split(marker, 1)[1] for c in self.calls if c.startswith("shared/rxe-vm/run.sh")]


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    def script(path: Path, body: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)

    for environment in ENVIRONMENTS:
        script(tmp_path / "cache" / environment / "bin" / "pip", _PIP)
        script(tmp_path / "cache" / environment / "bin" / "python", _PYTHON)
    for tool in ("ruff", "mypy"):
        script(tmp_path / "cache" / "venv" / "bin" / tool, _RECORD)
    for step in ("install.sh", "run.sh"):
        script(tmp_path / "shared" / "rxe-vm" / step, _RECORD)
    script(tmp_path / "bin" / "dpkg", "exit 0\n")
    return tmp_path


def _dev_test(fake: Path, *args: str, pip_fails_in: str = "none") -> Run:
    log = fake / "calls.log"
    log.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PATH": f"{fake / 'bin'}:{os.environ['PATH']}",
        "KVCONNECT_CACHE": str(fake / "cache"),
        "KVCONNECT_SHARED": str(fake / "shared"),
        "FAKE_ROOT": str(fake),
        "FAKE_LOG": str(fake / "calls.log"),
        "FAKE_PIP_FAIL": pip_fails_in,
    }
    done = subprocess.run(
        ["bash", str(ROOT / "dev.sh"), "test", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return Run(done.returncode, done.stdout + done.stderr, calls)


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_a_failed_install_fails_dev_sh_before_its_tests(fake: Path, environment: str) -> None:
    run = _dev_test(fake, pip_fails_in=environment)
    assert run.code == 1, run.output
    assert "No matching distribution" in run.output, "pip's own error is shown"
    assert "pip failed (exit 1)" in run.output
    assert run.pytest_runs(environment) == [], "no tests in a broken environment"
    assert run.vm_runs() == []


def test_pip_noise_is_hidden_and_a_good_install_goes_on(fake: Path) -> None:
    run = _dev_test(fake)
    assert run.code == 0, run.output
    assert "is ignored" not in run.output
    assert "require_native=1" in run.calls, "the native build stays required"
    assert run.pytest_runs("venv") == [""]
    assert run.pytest_runs("sglang-venv") == ["tests/sglang"]
    events = "tests/router/test_events_vllm.py"
    assert run.pytest_runs("vllm-venv") == [f"tests/vllm {events}"]
    router = "tests/router/test_router_end_to_end.py"
    assert run.pytest_runs("vllm-cpu-venv") == [f"tests/vllm {events} {router}"]
    assert run.vm_runs() == ["tests/rdma"]
    # an engine environment whose engine is missing fails instead of skipping its tests
    assert run.requires("venv") == [""]
    assert run.requires("sglang-venv") == ["KVCONNECT_REQUIRE_SGLANG=1"]
    assert run.requires("vllm-venv") == ["KVCONNECT_REQUIRE_VLLM=1"]
    cpu = "KVCONNECT_REQUIRE_VLLM=1 KVCONNECT_REQUIRE_VLLM_CPU=1"
    assert run.requires("vllm-cpu-venv") == [cpu]


def test_options_reach_every_suite(fake: Path) -> None:
    run = _dev_test(fake, "-x", "-k", "sglang or vllm", "-q")
    assert run.code == 0, run.output
    options = "-x -k sglang or vllm -q"
    assert run.pytest_runs("venv") == [options]
    assert run.pytest_runs("sglang-venv") == [f"{options} tests/sglang"]
    events = "tests/router/test_events_vllm.py"
    assert run.pytest_runs("vllm-venv") == [f"{options} tests/vllm {events}"]
    router = "tests/router/test_router_end_to_end.py"
    assert run.pytest_runs("vllm-cpu-venv") == [f"{options} tests/vllm {events} {router}"]
    assert run.vm_runs() == [f"{options} tests/rdma"]


def test_paths_select_the_suites_they_name(fake: Path) -> None:
    run = _dev_test(fake, "-x", "tests/sglang/test_plugin.py", "tests/store")
    assert run.code == 0, run.output
    assert run.pytest_runs("venv") == ["-x tests/sglang/test_plugin.py tests/store"]
    assert run.pytest_runs("sglang-venv") == ["-x tests/sglang/test_plugin.py"]
    assert run.pytest_runs("vllm-venv") == []
    assert run.pytest_runs("vllm-cpu-venv") == []
    assert run.vm_runs() == []
    run = _dev_test(fake, "tests/router/test_router_end_to_end.py")
    assert run.pytest_runs("vllm-cpu-venv") == ["tests/router/test_router_end_to_end.py"]
    assert run.pytest_runs("vllm-venv") == []
    run = _dev_test(fake, "tests/rdma/test_rdma.py::test_one", "-q")
    assert run.vm_runs() == ["-q tests/rdma/test_rdma.py::test_one"]
    assert run.pytest_runs("sglang-venv") == []


@pytest.mark.parametrize("paths", [("tests",), ("tests/transfer", "tests/store")])
def test_the_fast_loop_builds_and_runs_only_the_main_suite(
    fake: Path, paths: tuple[str, ...]
) -> None:
    run = _dev_test(fake, "-k", "lease", *paths)
    assert run.code == 0, run.output
    assert run.pytest_runs("venv") == [f"-k lease {' '.join(paths)}"]
    for environment in ENVIRONMENTS[1:]:
        assert run.pytest_runs(environment) == []
        assert not [c for c in run.calls if c.startswith(f"cache/{environment}/bin/pip")]
    assert run.vm_runs() == []
    assert not [c for c in run.calls if c.startswith("shared/rxe-vm/install.sh")]
