"""Which devices and data paths this machine has."""

from __future__ import annotations

import os

import pytest

from kvconnect.transfer.datapath.iov import native_available

DATAPATHS = ["native", "python"]


def rdma_present() -> bool:
    """An RDMA device (a real NIC or Soft-RoCE) is present."""
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


def native_mode(datapath: str) -> str:
    """Config value for a data-path parameter; the native one must really be built."""
    if datapath == "native" and not native_available():
        pytest.fail("kvconnect._native is not built (pip install with a C compiler)")
    return "on" if datapath == "native" else "off"
