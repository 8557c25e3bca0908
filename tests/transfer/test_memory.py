from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvconnect.errors import RegionBusy, RegistrationError
from kvconnect.transfer.memory import (
    SHM_MAGIC,
    Access,
    MemoryKind,
    MemoryRegistry,
    read_shm_header,
)
from tests.support.fakes import FakeCudaArray


@pytest.fixture
def registry() -> MemoryRegistry:
    reg = MemoryRegistry()
    yield reg  # type: ignore[misc]
    reg.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(4096, dtype=np.uint8),
        lambda: np.zeros((16, 32), dtype=np.float32),
        lambda: bytearray(b"x" * 1000),
        lambda: mmap.mmap(-1, 8192),
    ],
    ids=["numpy", "numpy-2d-f32", "bytearray", "mmap"],
)
def test_buffer_protocol_objects_register_zero_copy(registry: MemoryRegistry, make: object) -> None:
    buffer = make()  # type: ignore[operator]
    region = registry.register(buffer)
    assert region.kind is MemoryKind.HOST
    assert region.length == memoryview(buffer).nbytes
    assert region.writable
    region.view[0] = 0xAB  # a view of the same memory, not a copy
    assert memoryview(buffer).cast("B")[0] == 0xAB


def test_readonly_buffer_is_readonly_region(registry: MemoryRegistry) -> None:
    region = registry.register(b"immutable")
    assert not region.writable
    with pytest.raises(RegistrationError, match="read-only"):
        registry.register(b"immutable", writable=True)


def test_torch_cpu_tensor_registers_its_storage(registry: MemoryRegistry) -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(1024, dtype=torch.bfloat16)
    region = registry.register(tensor)
    assert region.length == 2048
    assert region.address == tensor.data_ptr()
    region.view[:2] = b"\x80\x3f"  # bfloat16 1.0
    assert float(tensor[0]) == 1.0
    with pytest.raises(RegistrationError, match="non-contiguous"):
        registry.register(torch.zeros(8, 8)[:, 1])


def test_cuda_array_interface_registers_device_memory(registry: MemoryRegistry) -> None:
    fake = FakeCudaArray(np.zeros((4, 256), dtype=np.float16), device=3)
    region = registry.register(fake)
    assert region.kind is MemoryKind.CUDA
    assert (region.length, region.device, region.address) == (2048, 3, fake.host.ctypes.data)
    with pytest.raises(Exception, match="no view"):
        _ = region.view


def test_noncontiguous_and_empty_buffers_are_refused(registry: MemoryRegistry) -> None:
    with pytest.raises(RegistrationError, match="non-contiguous"):
        registry.register(np.zeros((8, 8), dtype=np.uint8)[:, ::2])
    with pytest.raises(RegistrationError, match="empty"):
        registry.register(bytearray())
    with pytest.raises(RegistrationError, match="neither the buffer protocol"):
        registry.register(object())
    with pytest.raises(RegistrationError, match="non-contiguous CUDA"):
        registry.register(FakeCudaArray(np.zeros((4, 4), dtype=np.uint8), strides=(1, 4)))


def test_acquire_checks_bounds_and_permissions(registry: MemoryRegistry) -> None:
    rw = registry.register(bytearray(100))
    ro = registry.register(bytes(100))
    assert registry.acquire(rw.id, 0, 100, write=True)[0] is Access.OK
    assert registry.acquire(rw.id, 50, 51, write=False)[0] is Access.OUT_OF_BOUNDS
    assert registry.acquire(rw.id, -1, 1, write=False)[0] is Access.OUT_OF_BOUNDS
    assert registry.acquire(rw.id, 0, 0, write=False)[0] is Access.OUT_OF_BOUNDS
    assert registry.acquire(ro.id, 0, 1, write=True)[0] is Access.READ_ONLY
    assert registry.acquire(12345, 0, 1, write=False)[0] is Access.UNKNOWN_REGION


def test_unregister_refuses_while_in_use(registry: MemoryRegistry) -> None:
    region = registry.register(bytearray(64))
    access, held = registry.acquire(region.id, 0, 64, write=False)
    assert access is Access.OK
    assert held is region
    with pytest.raises(RegionBusy):
        registry.unregister(region)
    registry.release(region)
    registry.unregister(region)
    assert registry.get(region.id) is None
    with pytest.raises(RegistrationError, match="not registered"):
        registry.unregister(region)


def test_shared_allocation_has_live_header_until_unregistered(registry: MemoryRegistry) -> None:
    region = registry.allocate(10_000)
    assert region.shareable
    assert region.length == 10_000
    peer_view = mmap.mmap(region.shared_fd, mmap.PAGESIZE + 10_000)  # what a peer maps
    region.view[:5] = b"hello"
    assert peer_view[mmap.PAGESIZE : mmap.PAGESIZE + 5] == b"hello"
    assert read_shm_header(peer_view) == (SHM_MAGIC, region.id, 10_000, 1)
    registry.unregister(region)
    assert read_shm_header(peer_view)[3] == 0
    peer_view.close()


def test_hugepage_allocation_succeeds_or_explains(registry: MemoryRegistry) -> None:
    with open("/proc/sys/vm/nr_hugepages", encoding="ascii") as handle:
        reserved = int(handle.read())
    if reserved >= 2:
        region = registry.allocate(1 << 20, hugepages=True)
        region.view[:4] = b"huge"
        assert region.view[:4] == b"huge"
    else:
        with pytest.raises(RegistrationError, match="huge pages reserved"):
            registry.allocate(1 << 20, hugepages=True)


def test_fence_moves_a_region_to_a_new_id_and_counts_old_accesses(
    registry: MemoryRegistry,
) -> None:
    region = registry.allocate(4096)
    region.view[:5] = b"bytes"
    access, held = registry.acquire(region.id, 0, 64, write=True)  # a served access in flight
    assert access is Access.OK
    fresh = registry.fence(region)
    assert fresh.id != region.id
    assert fresh.view[:5] == b"bytes"
    assert fresh.shared_fd == region.shared_fd, "same memory"
    assert read_shm_header(fresh._shared.mapping)[1:] == (fresh.id, 4096, 1)  # type: ignore[union-attr]
    assert registry.acquire(region.id, 0, 1, write=False)[0] is Access.UNKNOWN_REGION
    assert registry.users(region) == 1
    assert held is not None
    registry.release(held)
    assert registry.users(region) == 0
    assert registry.get(fresh.id) is fresh
    with pytest.raises(RegistrationError, match="not registered"):
        registry.fence(region)
