"""Nodes in network namespaces, each joined to this namespace by a veth link limited to the
same rate in both directions (tbf), this namespace routing between them: the topology of
``kvconnect bench p2p`` and of the P2P tests. Needs root, iproute2 and tc.

Node ``i`` is ``10.<net>.<i>.2`` inside its namespace; this namespace is ``10.<net>.<i>.1`` on
its link (a /24 each, so no two nodes count as near by subnet).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvconnect.lifecycle import Closing

_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
_STARS = itertools.count()  # device names differ between stars of one process


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"needs {' and '.join(missing)}" if missing else None


def _run(*words: str) -> None:
    subprocess.run(list(words), check=True, capture_output=True, text=True)


@dataclass(frozen=True, slots=True)
class Node:
    """One namespace: its name, its address inside, this namespace's address on its link."""

    netns: str
    address: str
    gateway: str

    def command(self, args: list[str]) -> list[str]:
        """``args`` run inside this namespace."""
        return ["ip", "netns", "exec", self.netns, *args]


class Star(Closing):
    """``count`` namespaces, each linked to this one at ``rate_mbit`` (None: unlimited)."""

    def __init__(self, count: int, rate_mbit: float | None, tag: str = "p2p", net: int = 77):
        self._tag = f"{tag}{os.getpid() % 10000}{next(_STARS) % 10}"
        self._rate = rate_mbit
        self.nodes = [
            Node(f"kvc-{self._tag}-{i}", f"10.{net}.{i}.2", f"10.{net}.{i}.1") for i in range(count)
        ]
        self._forward = ""
        self._made: list[Node] = []
        try:
            self._forward = _FORWARD.read_text().strip()
            _FORWARD.write_text("1\n")
            for index, node in enumerate(self.nodes):
                self._link(index, node)
        except BaseException:
            self.close()
            raise

    def _link(self, index: int, node: Node) -> None:
        outside, inside = f"kv{self._tag}o{index}", f"kv{self._tag}i{index}"
        _run("ip", "netns", "add", node.netns)
        self._made.append(node)
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        _run("ip", "link", "set", inside, "netns", node.netns)
        _run("ip", "addr", "add", f"{node.gateway}/24", "dev", outside)
        _run("ip", "link", "set", outside, "up")
        inner = ["ip", "-n", node.netns]
        _run(*inner, "addr", "add", f"{node.address}/24", "dev", inside)
        _run(*inner, "link", "set", inside, "up")
        _run(*inner, "link", "set", "lo", "up")
        _run(*inner, "route", "add", "default", "via", node.gateway)
        if self._rate is not None:
            self._limit(outside, None)
            self._limit(inside, node.netns)

    def _limit(self, device: str, netns: str | None) -> None:
        rate_bytes = self._rate * 1e6 / 8 if self._rate else 0
        burst = max(64 * 1024, int(rate_bytes / 100))  # 10 ms of the rate, at least a GSO packet
        prefix = ["ip", "netns", "exec", netns] if netns else []
        tbf = ["tbf", "rate", f"{self._rate}mbit", "burst", str(burst), "latency", "200ms"]
        _run(*prefix, "tc", "qdisc", "add", "dev", device, "root", *tbf)

    def close(self) -> None:
        """Delete the links and namespaces, restore forwarding."""
        for index, node in enumerate(self._made):
            with contextlib.suppress(subprocess.CalledProcessError):  # else it lingers a while
                _run("ip", "link", "del", f"kv{self._tag}o{index}")
            with contextlib.suppress(subprocess.CalledProcessError):
                _run("ip", "netns", "del", node.netns)
        self._made = []
        if self._forward:
            with contextlib.suppress(OSError):
                _FORWARD.write_text(self._forward + "\n")
            self._forward = ""
