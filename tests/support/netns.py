"""A network namespace joined to this one by a veth pair (needs root and iproute2)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Namespace:
    """``name``, reached at ``inside`` (its veth end ``inside_dev``) from ``outside`` here."""

    name: str
    outside: str
    inside: str
    outside_dev: str
    inside_dev: str


def ip(command: str) -> None:
    """``ip`` with space-separated words (no shell); raises CalledProcessError."""
    subprocess.run(["ip", *command.split()], check=True, capture_output=True, text=True)


def run_in(ns: str, command: str) -> None:
    """A command (space-separated words) inside namespace ``ns``."""
    subprocess.run(["ip", "netns", "exec", ns, *command.split()], check=True, capture_output=True)


@contextlib.contextmanager
def namespace(tag: str, subnet: str) -> Iterator[Namespace]:
    """A namespace ``kvc-<tag>-<pid>`` with ``<subnet>.1`` here and ``<subnet>.2`` in it (a
    /24); skips the test without root or iproute2."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a network namespace")
    ns = Namespace(
        f"kvc-{tag}-{os.getpid()}", f"{subnet}.1", f"{subnet}.2", f"kv{tag}0", f"kv{tag}1"
    )
    try:
        ip(f"netns add {ns.name}")
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot create a network namespace: {exc}")
    try:
        ip(f"link add {ns.outside_dev} type veth peer name {ns.inside_dev} netns {ns.name}")
        ip(f"addr add {ns.outside}/24 dev {ns.outside_dev}")
        ip(f"link set {ns.outside_dev} up")
        ip(f"-n {ns.name} addr add {ns.inside}/24 dev {ns.inside_dev}")
        ip(f"-n {ns.name} link set {ns.inside_dev} up")
        ip(f"-n {ns.name} link set lo up")
        yield ns
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            ip(f"netns del {ns.name}")
        with contextlib.suppress(subprocess.CalledProcessError):
            ip(f"link del {ns.outside_dev}")  # may outlive the namespace for a while
