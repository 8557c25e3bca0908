"""NIC discovery and ordering from a recorded sysfs tree built in a temporary directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvconnect.cli import main
from kvconnect.transfer.transports.rdma import topology
from kvconnect.transfer.transports.rdma.topology import Device, Distance

# Two sockets: NUMA 0 has a PCIe switch below root port 00:01.0 with GPU 0 and mlx5_0; NUMA 1
# has GPU 1 (root port 80:01.0) and mlx5_1 under another root port (80:03.0); rxe0 is virtual.
PCI = {
    "0000:03:00.0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0", 0),
    "0000:04:00.0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:04:00.0", 0),
    "0000:81:00.0": ("pci0000:80/0000:80:01.0/0000:81:00.0", 1),
    "0000:83:00.0": ("pci0000:80/0000:80:03.0/0000:83:00.0", 1),
}
GPUS = {"0000:03:00.0", "0000:81:00.0"}
NICS = {"mlx5_0": "0000:04:00.0", "mlx5_1": "0000:83:00.0"}


def fake_sysfs(root: Path) -> Path:
    for bdf, (chain, numa) in PCI.items():
        device = root / "devices" / chain
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{numa}\n")
        gpu = bdf in GPUS
        (device / "vendor").write_text("0x10de\n" if gpu else "0x15b3\n")
        (device / "class").write_text("0x030200\n" if gpu else "0x020700\n")
        link = root / "bus" / "pci" / "devices" / bdf
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(device, link)
    for name, bdf in NICS.items():
        entry = root / "devices" / PCI[bdf][0] / "infiniband" / name
        entry.mkdir(parents=True)
        os.symlink(root / "devices" / PCI[bdf][0], entry / "device")
        (root / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
        os.symlink(entry, root / "class" / "infiniband" / name)
    virtual = root / "devices" / "virtual" / "infiniband" / "rxe0"
    virtual.mkdir(parents=True)
    os.symlink(virtual, root / "class" / "infiniband" / "rxe0")
    return root


def test_discovery_reads_pci_paths_and_numa_nodes(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path)
    nics = topology.discover_nics(root)
    assert nics == [
        Device("mlx5_0", ("0000:00:01.0", "0000:01:00.0", "0000:02:10.0", "0000:04:00.0"), 0),
        Device("mlx5_1", ("0000:80:03.0", "0000:83:00.0"), 1),
        Device("rxe0", (), -1),
    ]
    gpus = topology.discover_gpus(root)
    assert [g.name for g in gpus] == ["0000:03:00.0", "0000:81:00.0"]
    assert [g.numa_node for g in gpus] == [0, 1]


def test_nics_are_ordered_switch_then_numa_then_any(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path)
    nics = topology.discover_nics(root)
    gpu0, gpu1 = topology.discover_gpus(root)
    assert [topology.distance(n, gpu0) for n in nics] == [
        Distance.SAME_SWITCH,
        Distance.ANY,
        Distance.ANY,
    ]
    assert [topology.distance(n, gpu1) for n in nics] == [
        Distance.ANY,
        Distance.SAME_NUMA,
        Distance.ANY,
    ]
    assert [n.name for n in topology.order_nics(nics, gpu1)] == ["mlx5_1", "mlx5_0", "rxe0"]
    assert [n.name for n in topology.nearest_tier(nics, gpu0)] == ["mlx5_0"]
    # Host memory has no device: every NIC is as good as any other, in discovery order.
    assert topology.nearest_tier(nics, None) == nics


def test_matrix_names_every_gpu_and_nic(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path)
    text = topology.matrix(topology.discover_nics(root), topology.discover_gpus(root))
    lines = text.splitlines()
    assert "mlx5_0 (numa 0" in lines[0]
    assert "rxe0 (numa -1, pci virtual)" in lines[0]
    assert lines[2].split() == ["0000:03:00.0", "SAME_SWITCH", "ANY", "ANY"]
    assert lines[3].split() == ["0000:81:00.0", "ANY", "SAME_NUMA", "ANY"]


def test_a_machine_without_rdma_has_no_nics(tmp_path: Path) -> None:
    assert topology.discover_nics(tmp_path) == []
    assert topology.discover_gpus(tmp_path) == []
    assert topology.matrix([], []) == "NICs: none\nGPUs: none"


def test_topology_command_prints_the_matrix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = fake_sysfs(tmp_path)
    assert main(["topology", "--sysfs", str(root)]) == 0
    out = capsys.readouterr().out
    assert out == topology.matrix(topology.discover_nics(root), topology.discover_gpus(root)) + "\n"
