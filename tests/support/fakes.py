"""Fakes for unit tests of logic around hardware (never a replacement for an integration test)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


class FakeCudaArray:
    """Host memory presented through ``__cuda_array_interface__``, as a GPU array would be."""

    def __init__(
        self, host: np.ndarray, device: int = 0, strides: tuple[int, ...] | None = None
    ) -> None:
        self.host = host
        self.device = _Device(device)
        self._strides = strides

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "data": (self.host.ctypes.data, False),
            "shape": self.host.shape,
            "typestr": self.host.dtype.str,
            "strides": self._strides,
            "version": 3,
        }


class _Device:
    def __init__(self, index: int) -> None:
        self.index = index


class HostCopier:
    """A DeviceCopier for fake device memory that is really host memory; counts its copies."""

    def __init__(self) -> None:
        self.copies = 0
        self.pinned = 0

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.copies += 1
        ctypes.memmove(dst, src, nbytes)

    def alloc_pinned(self, nbytes: int) -> memoryview:
        self.pinned += 1
        return memoryview(bytearray(nbytes))
