"""CUDA runtime access through ctypes: device copies and pinned host buffers.

Loaded lazily on first use, so hosts without CUDA never touch it. The engine only needs two
operations, expressed by :class:`DeviceCopier`; tests on CPU-only machines inject a copier that
moves host memory, which exercises all the staging logic around it.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Final, Protocol

from kvconnect.errors import BrokenError

_CUDA_MEMCPY_DEFAULT: Final = 4  # cudaMemcpyDefault: direction inferred from unified addressing
_RUNTIME_NAMES: Final = (
    "libcudart.so",
    "libcudart.so.13",
    "libcudart.so.12",
    "libcudart.so.11.0",
)


class DeviceCopier(Protocol):
    """Copies involving device memory, and page-locked host buffers for staging."""

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``src`` to ``dst`` (host or device); blocks until done."""

    def alloc_pinned(self, nbytes: int) -> memoryview:
        """A host buffer suitable for DMA; freed when the returned view's owner is collected."""


class CudaRuntime:
    """:class:`DeviceCopier` over libcudart (``cudaMemcpy``, ``cudaHostAlloc``)."""

    def __init__(self) -> None:
        self._lib = _load_runtime()
        self._lib.cudaMemcpy.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
        ]
        self._lib.cudaHostAlloc.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_size_t,
            ctypes.c_uint,
        ]
        self._lib.cudaFreeHost.argtypes = [ctypes.c_void_p]

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._check(self._lib.cudaMemcpy(dst, src, nbytes, _CUDA_MEMCPY_DEFAULT), "cudaMemcpy")

    def alloc_pinned(self, nbytes: int) -> memoryview:
        pointer = ctypes.c_void_p()
        self._check(self._lib.cudaHostAlloc(ctypes.byref(pointer), nbytes, 0), "cudaHostAlloc")
        address = int(pointer.value or 0)
        raw = (ctypes.c_char * nbytes).from_address(address)
        weakref.finalize(raw, self._lib.cudaFreeHost, address)
        return memoryview(raw).cast("B")

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            self._lib.cudaGetErrorString.restype = ctypes.c_char_p
            text = self._lib.cudaGetErrorString(status).decode(errors="replace")
            raise BrokenError(f"{call} failed: {text} ({status})")


def _load_runtime() -> ctypes.CDLL:
    errors = []
    for name in _RUNTIME_NAMES:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    raise BrokenError("CUDA memory registered but no CUDA runtime loads: " + "; ".join(errors))


_default: CudaRuntime | None = None
_default_lock = threading.Lock()


def default_copier() -> DeviceCopier:
    """The process's CUDA runtime copier, loaded on first use."""
    global _default  # noqa: PLW0603 - one runtime handle per process, created lazily
    with _default_lock:
        if _default is None:
            _default = CudaRuntime()
        return _default


def cuda_device_count() -> int:
    """Number of CUDA devices the driver reports; 0 without a driver. Never raises."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value
