"""Where NICs and GPUs sit: discovery from sysfs (I/O) and NIC ordering by distance (pure).

A device's *PCI path* is the chain of PCI functions from its root port down to itself, read
from the resolved sysfs path (``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/...``). Two
devices whose paths share a first element sit below the same root port, hence behind the same
PCIe switch: traffic between them never crosses the CPU's interconnect. That is the nearest
tier; then the same NUMA node; then anything.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

SYSFS: Final = Path("/sys")
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_NVIDIA: Final = "0x10de"
_GPU_CLASSES: Final = ("0x0300", "0x0302")  # VGA and 3D controllers


class Distance(enum.IntEnum):
    """How far a NIC is from a memory's device; smaller is nearer."""

    SAME_SWITCH = 0
    SAME_NUMA = 1
    ANY = 2


@dataclass(frozen=True, slots=True)
class Device:
    """A NIC (``name`` is its RDMA device name) or a GPU (``name`` is its PCI bus id)."""

    name: str
    pci_path: tuple[str, ...]
    numa_node: int
    """-1 when unknown (virtual devices, single-node machines)."""


def distance(nic: Device, near: Device) -> Distance:
    """Tier of ``nic`` seen from ``near`` (a GPU)."""
    if nic.pci_path and near.pci_path and nic.pci_path[0] == near.pci_path[0]:
        return Distance.SAME_SWITCH
    if nic.numa_node >= 0 and nic.numa_node == near.numa_node:
        return Distance.SAME_NUMA
    return Distance.ANY


def order_nics(nics: Sequence[Device], near: Device | None) -> list[Device]:
    """``nics`` nearest first (stable within a tier); all equal when ``near`` is None."""
    if near is None:
        return list(nics)
    return sorted(nics, key=lambda nic: distance(nic, near))


def nearest_tier(nics: Sequence[Device], near: Device | None) -> list[Device]:
    """The NICs of the nearest tier present: the ones to spread a region's traffic over."""
    ordered = order_nics(nics, near)
    if near is None or not ordered:
        return ordered
    best = distance(ordered[0], near)
    return [nic for nic in ordered if distance(nic, near) == best]


def discover_nics(root: Path = SYSFS) -> list[Device]:
    """RDMA devices under ``root``/class/infiniband, by name."""
    base = root / "class" / "infiniband"
    if not base.is_dir():
        return []
    return [_device(name, base / name / "device") for name in sorted(os.listdir(base))]


def discover_gpus(root: Path = SYSFS) -> list[Device]:
    """NVIDIA GPUs under ``root``/bus/pci/devices, in PCI bus order (CUDA's PCI_BUS_ID order)."""
    base = root / "bus" / "pci" / "devices"
    if not base.is_dir():
        return []
    gpus = []
    for bdf in sorted(os.listdir(base)):
        entry = base / bdf
        if _read(entry / "vendor") == _NVIDIA and _read(entry / "class").startswith(_GPU_CLASSES):
            gpus.append(_device(bdf, entry))
    return gpus


def matrix(nics: Sequence[Device], gpus: Sequence[Device]) -> str:
    """A text table: one row per GPU, one column per NIC, each cell the distance tier."""
    names = [nic.name for nic in nics]
    width = max([len(n) for n in names] + [len(Distance.SAME_SWITCH.name)])
    lines = [
        "NICs: "
        + (", ".join(f"{n.name} (numa {n.numa_node}, pci {_path(n)})" for n in nics) or "none")
    ]
    if not gpus:
        lines.append("GPUs: none")
        return "\n".join(lines)
    lines.append(" " * 14 + "".join(f"{name:>{width + 2}}" for name in names))
    for gpu in gpus:
        cells = "".join(f"{distance(nic, gpu).name:>{width + 2}}" for nic in nics)
        lines.append(f"{gpu.name:<14}{cells}")
    return "\n".join(lines)


def _device(name: str, device_link: Path) -> Device:
    try:
        resolved = device_link.resolve(strict=True)
    except OSError:  # virtual devices (rxe, siw) have no PCI function
        return Device(name, (), -1)
    return Device(name, _pci_chain(resolved.parts), _numa(resolved))


def _pci_chain(parts: Iterable[str]) -> tuple[str, ...]:
    return tuple(part for part in parts if _BDF.match(part))


def _numa(device_dir: Path) -> int:
    try:
        return int(_read(device_dir / "numa_node") or "-1")
    except ValueError:
        return -1


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _path(device: Device) -> str:
    return "/".join(device.pci_path) or "virtual"
