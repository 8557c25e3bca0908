"""Registered memory: regions, the registry that validates every access, shared allocations.

A :class:`MemoryRegion` is what ``TransferEngine.register``/``allocate`` return. The registry is
the single authority for "may this peer touch these bytes": the listener and the same-process
transport call :meth:`MemoryRegistry.acquire` before touching a region and ``release`` after, so
``unregister`` can refuse while a transfer uses the region.
"""

from __future__ import annotations

import ctypes
import enum
import fcntl
import math
import mmap
import os
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Final, final

import numpy as np

from kvconnect.errors import InvalidRequest, RegionBusy, RegistrationError
from kvconnect.transfer.source import FileSource


class MemoryKind(enum.Enum):
    """Where the bytes live."""

    HOST = "host"
    CUDA = "cuda"
    FILE = "file"
    """Not memory: a :class:`~kvconnect.transfer.source.FileSource` produces the bytes."""


class Access(enum.IntEnum):
    """Outcome of an access check (also the status codes on the wire)."""

    OK = 0
    UNKNOWN_REGION = 1
    OUT_OF_BOUNDS = 2
    READ_ONLY = 3


# Shared regions carry a one-page header so a peer that mapped the region can tell whether it is
# still registered (and that it mapped the region it asked for).
SHM_HEADER: Final = mmap.PAGESIZE
SHM_MAGIC: Final = b"KVCSHM01"
_SHM_HEADER_FMT: Final = struct.Struct("<8sQQQ")
_HUGE_PAGE: Final = 2 << 20  # magic, region id, length, state (1 = live)
_F_SEAL_FUTURE_WRITE: Final = 0x0010  # Linux >= 5.1; not in the fcntl module


def read_shm_header(buf: memoryview | mmap.mmap) -> tuple[bytes, int, int, int]:
    """Decode a shared region's header: (magic, region id, length, state)."""
    magic, region_id, length, state = _SHM_HEADER_FMT.unpack_from(buf, 0)
    return magic, region_id, length, state


@final
class MemoryRegion:
    """A registered, contiguous range of memory, identified by ``id`` within its engine.

    Host regions expose ``view`` (a writable-or-not 1-D byte memoryview). CUDA regions expose only
    ``address``/``device``; transports that cannot reach device memory stage through host buffers.
    FILE regions expose only ``source`` (read-only, never shareable, ``address`` 0). The region
    keeps the registered object alive until it is unregistered.
    """

    __slots__ = (
        "_keepalive",
        "_shared",
        "_source",
        "_view",
        "address",
        "device",
        "id",
        "kind",
        "length",
        "private",
        "writable",
    )

    def __init__(
        self,
        *,
        region_id: int,
        kind: MemoryKind,
        address: int,
        length: int,
        writable: bool,
        device: int = -1,
        view: memoryview | None = None,
        keepalive: object = None,
        shared: _SharedMemory | None = None,
        source: FileSource | None = None,
        private: bool = False,
    ) -> None:
        self.id = region_id
        self.kind = kind
        self.address = address
        self.length = length
        self.writable = writable
        self.device = device
        self._view = view
        self._keepalive = keepalive
        self._shared = shared
        self._source = source
        self.private = private
        """Local side of this engine's requests only: never published, peers are refused."""

    @property
    def view(self) -> memoryview:
        """The region's bytes (host regions only)."""
        if self._view is None:
            raise InvalidRequest(f"region {self.id} is {self.kind.value} memory and has no view")
        return self._view

    @property
    def source(self) -> FileSource:
        """What produces the region's bytes (FILE regions only)."""
        if self._source is None:
            raise InvalidRequest(f"region {self.id} is {self.kind.value} memory, not a file")
        return self._source

    @property
    def shareable(self) -> bool:
        """Whether same-host peers can map this region (it came from ``allocate``)."""
        return self._shared is not None

    @property
    def shared_fd(self) -> int:
        """File descriptor of the shared memory (shareable regions only)."""
        if self._shared is None:
            raise InvalidRequest(f"region {self.id} is not shared memory")
        return self._shared.fd

    def __repr__(self) -> str:
        return (
            f"MemoryRegion(id={self.id}, kind={self.kind.value}, length={self.length}, "
            f"writable={self.writable}, shareable={self.shareable})"
        )


class _SharedMemory:
    """A memfd and its mapping; the fd is closed on withdrawal or, at the latest, on collection."""

    __slots__ = ("__weakref__", "_closer", "fd", "mapping")

    def __init__(self, fd: int, mapping: mmap.mmap) -> None:
        self.fd = fd
        self.mapping = mapping
        self._closer = weakref.finalize(self, os.close, fd)

    def close_fd(self) -> None:
        self._closer()
        self.fd = -1


class MemoryRegistry:
    """Thread-safe table of an engine's regions, with per-region user counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, MemoryRegion] = {}
        self._users: dict[int, int] = {}
        self._next_id = 1
        self.on_withdraw: Callable[[MemoryRegion], None] | None = None
        """Called (outside the lock) for each region that stops being registered under its id:
        unregistered, fenced or closed. The RDMA transport deregisters its MRs there."""

    def register(
        self, buffer: object, *, writable: bool | None = None, private: bool = False
    ) -> MemoryRegion:
        """Register ``buffer`` (buffer protocol, torch CPU tensor, or CUDA array interface)."""
        region = _describe(buffer, self._take_id(), writable)
        region.private = private
        with self._lock:
            self._regions[region.id] = region
            self._users[region.id] = 0
        return region

    def allocate(
        self, nbytes: int, *, hugepages: bool = False, writable: bool = True
    ) -> MemoryRegion:
        """Allocate pre-faulted shared memory (memfd) of ``nbytes`` and register it.

        Its fd (what peers are given) can never shrink or grow the memory; for a read-only
        region it is a read-only fd and the memory is sealed against new writable mappings.
        """
        if nbytes <= 0:
            raise InvalidRequest(f"allocate: nbytes must be > 0, got {nbytes}")
        region_id = self._take_id()
        shared = _allocate_shared(region_id, nbytes, hugepages, writable)
        view = memoryview(shared.mapping)[SHM_HEADER : SHM_HEADER + nbytes]
        region = MemoryRegion(
            region_id=region_id,
            kind=MemoryKind.HOST,
            address=host_address(view),
            length=nbytes,
            writable=writable,
            view=view,
            shared=shared,
        )
        with self._lock:
            self._regions[region_id] = region
            self._users[region_id] = 0
        return region

    def register_source(self, source: FileSource, length: int) -> MemoryRegion:
        """Register ``length`` bytes produced by ``source`` as a read-only FILE region."""
        if length <= 0:
            raise RegistrationError(f"register_source: length must be > 0, got {length}")
        region = MemoryRegion(
            region_id=self._take_id(),
            kind=MemoryKind.FILE,
            address=0,
            length=length,
            writable=False,
            source=source,
        )
        with self._lock:
            self._regions[region.id] = region
            self._users[region.id] = 0
        return region

    def unregister(self, region: MemoryRegion) -> None:
        """Remove ``region``; RegionBusy while transfers use it."""
        with self._lock:
            if self._regions.get(region.id) is not region:
                raise RegistrationError(f"region {region.id} is not registered here")
            if self._users[region.id]:
                raise RegionBusy(
                    f"region {region.id} is used by {self._users[region.id]} transfer(s)"
                )
            del self._regions[region.id]
            del self._users[region.id]
        _withdraw(region)
        self._notify_withdrawn([region])

    def alias(self, region: MemoryRegion) -> MemoryRegion:
        """``region``'s memory (a region of another registry) as a private region here; it
        keeps ``region`` alive. FILE regions have no memory to alias (RegistrationError)."""
        if region.kind is MemoryKind.FILE:
            raise RegistrationError(f"region {region.id} is a file source, not memory")
        fresh = _same_memory(region, self._take_id(), keepalive=region, shared=None, private=True)
        with self._lock:
            self._regions[fresh.id] = fresh
            self._users[fresh.id] = 0
        return fresh

    def fence(self, region: MemoryRegion) -> MemoryRegion:
        """The same memory under a new id; the old id is refused from now on (shared regions
        say so in their header, so peers that mapped it fail too). Accesses that began before
        may still run: :meth:`users` of the old region tells when they are over."""
        region_id = self._take_id()
        fresh = _same_memory(
            region,
            region_id,
            keepalive=region._keepalive,
            shared=region._shared,
            private=region.private,
        )
        with self._lock:
            if self._regions.get(region.id) is not region:
                raise RegistrationError(f"region {region.id} is not registered here")
            del self._regions[region.id]
            self._regions[region_id] = fresh
            self._users[region_id] = 0
            if not self._users[region.id]:
                del self._users[region.id]
            if fresh._shared is not None:
                _SHM_HEADER_FMT.pack_into(
                    fresh._shared.mapping, 0, SHM_MAGIC, region_id, fresh.length, 1
                )
        self._notify_withdrawn([region])
        return fresh

    def users(self, region: MemoryRegion) -> int:
        """Accesses (served or initiated) still using ``region``, registered or fenced."""
        with self._lock:
            return self._users.get(region.id, 0)

    def get(self, region_id: int) -> MemoryRegion | None:
        """The region with ``region_id`` or None."""
        with self._lock:
            return self._regions.get(region_id)

    def owns(self, region: MemoryRegion) -> bool:
        """Whether ``region`` is currently registered here (identity, not just id)."""
        with self._lock:
            return self._regions.get(region.id) is region

    def acquire(
        self, region_id: int, offset: int, length: int, *, write: bool
    ) -> tuple[Access, MemoryRegion | None]:
        """Check a peer's access (private regions are unknown to peers) and, when allowed,
        count a user until :meth:`release`."""
        access, regions = self.acquire_many((region_id, offset, length), write=write)
        return access, regions[0] if regions else None

    def acquire_many(
        self, flat: Sequence[int], *, write: bool
    ) -> tuple[Access, list[MemoryRegion]]:
        """:meth:`acquire` for flat (region id, offset, length) triples, all or none."""
        regions: list[MemoryRegion] = []
        with self._lock:
            for i in range(0, len(flat), 3):
                region_id, offset, length = flat[i], flat[i + 1], flat[i + 2]
                region = self._regions.get(region_id)
                if region is None or region.private:
                    access = Access.UNKNOWN_REGION
                elif offset < 0 or length <= 0 or offset + length > region.length:
                    access = Access.OUT_OF_BOUNDS
                elif write and not region.writable:
                    access = Access.READ_ONLY
                else:
                    regions.append(region)
                    continue
                return access, []
            for region in regions:
                self._users[region.id] += 1
        return Access.OK, regions

    def hold_many(self, regions: Sequence[MemoryRegion]) -> MemoryRegion | None:
        """Count a user of each region; if one is not registered, hold none and return it."""
        with self._lock:
            for region in regions:
                if self._regions.get(region.id) is not region:
                    return region
            for region in regions:
                self._users[region.id] += 1
            return None

    def release(self, region: MemoryRegion) -> None:
        """End one use started by :meth:`acquire`."""
        self.release_many([region])

    def release_many(self, regions: Sequence[MemoryRegion]) -> None:
        """End one use of each region (from :meth:`acquire` or :meth:`hold_many`)."""
        with self._lock:
            for region in regions:
                users = self._users.get(region.id)
                if users is None:
                    continue
                if users > 1 or region.id in self._regions:
                    self._users[region.id] = users - 1
                else:
                    del self._users[region.id]  # the last use of a fenced id

    def regions(self) -> tuple[MemoryRegion, ...]:
        """Snapshot of the registered regions, by id."""
        with self._lock:
            return tuple(self._regions[i] for i in sorted(self._regions))

    def close(self) -> None:
        """Withdraw every region (shared regions are marked dead for peers that mapped them)."""
        with self._lock:
            regions = list(self._regions.values())
            self._regions.clear()
            self._users.clear()
        for region in regions:
            _withdraw(region)
        self._notify_withdrawn(regions)

    def _notify_withdrawn(self, regions: Sequence[MemoryRegion]) -> None:
        hook = self.on_withdraw
        if hook is not None:
            for region in regions:
                hook(region)

    def _take_id(self) -> int:
        with self._lock:
            region_id = self._next_id
            self._next_id += 1
            return region_id


def _same_memory(
    region: MemoryRegion,
    region_id: int,
    *,
    keepalive: object,
    shared: _SharedMemory | None,
    private: bool,
) -> MemoryRegion:
    """A region with ``region``'s memory and attributes under ``region_id``."""
    return MemoryRegion(
        region_id=region_id,
        kind=region.kind,
        address=region.address,
        length=region.length,
        writable=region.writable,
        device=region.device,
        view=region._view,
        keepalive=keepalive,
        shared=shared,
        source=region._source,
        private=private,
    )


def _withdraw(region: MemoryRegion) -> None:
    shared = region._shared
    if shared is None or shared.fd < 0:
        return
    # Peers that mapped the region check this word before and after every copy.
    _SHM_HEADER_FMT.pack_into(shared.mapping, 0, SHM_MAGIC, region.id, region.length, 0)
    shared.close_fd()


def _allocate_shared(region_id: int, nbytes: int, hugepages: bool, writable: bool) -> _SharedMemory:
    size = SHM_HEADER + nbytes
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    if hugepages:
        # The header page becomes a huge page too; round up so the mapping is whole pages.
        size = -(-size // _HUGE_PAGE) * _HUGE_PAGE
        flags |= os.MFD_HUGETLB
    try:
        fd = os.memfd_create(f"kvconnect-region-{region_id}", flags)
    except OSError as exc:
        raise RegistrationError(f"cannot create shared memory: {exc}") from exc
    try:
        os.ftruncate(fd, size)
        # fallocate + MAP_POPULATE pre-faults the pages so first writes run at memcpy speed.
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except OSError as exc:
        os.close(fd)
        hint = " (are huge pages reserved? see vm.nr_hugepages)" if hugepages else ""
        raise RegistrationError(
            f"cannot allocate {nbytes} bytes of shared memory: {exc}{hint}"
        ) from exc
    _SHM_HEADER_FMT.pack_into(mapping, 0, SHM_MAGIC, region_id, nbytes, 1)
    try:
        fd = _seal(fd, writable)
    except OSError as exc:
        mapping.close()
        os.close(fd)
        raise RegistrationError(f"cannot seal shared memory: {exc}") from exc
    return _SharedMemory(fd=fd, mapping=mapping)


def _seal(fd: int, writable: bool) -> int:
    """Seal the memfd so whoever holds an fd of it cannot resize it (a shrink would crash this
    process on its next access) and, unless ``writable``, cannot map or write it afresh (this
    process's mapping stays writable); return the fd to keep and hand out: read-only for a
    read-only region, and ``fd`` itself is then closed."""
    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    if not writable:
        seals |= _F_SEAL_FUTURE_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)
    if writable:
        return fd
    readonly = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)
    return readonly


def _describe(buffer: object, region_id: int, writable: bool | None) -> MemoryRegion:
    if hasattr(buffer, "__cuda_array_interface__"):
        return _describe_cuda(buffer, region_id, writable)
    if _is_torch_tensor(buffer):
        return _describe_torch_cpu(buffer, region_id, writable)
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError as exc:
        raise RegistrationError(
            f"cannot register {type(buffer).__name__}: it has neither the buffer protocol, "
            "a torch CPU tensor's data_ptr, nor __cuda_array_interface__"
        ) from exc
    if not view.c_contiguous:
        raise RegistrationError("cannot register a non-contiguous buffer")
    view = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    return _host_region(region_id, view, buffer, writable)


def _host_region(
    region_id: int, view: memoryview, keepalive: object, writable: bool | None
) -> MemoryRegion:
    if view.nbytes == 0:
        raise RegistrationError("cannot register an empty buffer")
    if writable and view.readonly:
        raise RegistrationError("cannot register a read-only buffer as writable")
    return MemoryRegion(
        region_id=region_id,
        kind=MemoryKind.HOST,
        address=host_address(view),
        length=view.nbytes,
        writable=not view.readonly if writable is None else writable,
        view=view,
        keepalive=keepalive,
    )


def host_address(view: memoryview) -> int:
    """Address of the first byte of a host buffer (read-only buffers included)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _is_torch_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _describe_torch_cpu(tensor: object, region_id: int, writable: bool | None) -> MemoryRegion:
    t = tensor  # typed loosely: torch is optional and imported by the caller, not here
    if getattr(getattr(t, "device", None), "type", "cpu") != "cpu":
        raise RegistrationError(f"torch tensor on {t.device} has no __cuda_array_interface__")  # type: ignore[attr-defined]
    if not t.is_contiguous():  # type: ignore[attr-defined]
        raise RegistrationError("cannot register a non-contiguous torch tensor")
    nbytes = int(t.numel()) * int(t.element_size())  # type: ignore[attr-defined]
    if nbytes == 0:
        raise RegistrationError("cannot register an empty tensor")
    raw = (ctypes.c_char * nbytes).from_address(int(t.data_ptr()))  # type: ignore[attr-defined]
    view = memoryview(raw).cast("B")
    return _host_region(region_id, view, tensor, writable)


def _describe_cuda(buffer: object, region_id: int, writable: bool | None) -> MemoryRegion:
    cai = buffer.__cuda_array_interface__  # type: ignore[attr-defined]
    pointer, readonly = cai["data"]
    shape = tuple(cai["shape"])
    itemsize = int(cai["typestr"][2:])
    strides = cai.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, itemsize):
        raise RegistrationError("cannot register non-contiguous CUDA memory")
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        raise RegistrationError("cannot register an empty CUDA buffer")
    if writable and readonly:
        raise RegistrationError("cannot register read-only CUDA memory as writable")
    return MemoryRegion(
        region_id=region_id,
        kind=MemoryKind.CUDA,
        address=int(pointer),
        length=nbytes,
        writable=not readonly if writable is None else writable,
        device=_cuda_device(buffer),
        keepalive=buffer,
    )


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    step = itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def _cuda_device(buffer: object) -> int:
    device = getattr(buffer, "device", None)
    for attr in ("index", "id"):  # torch.device.index, cupy.cuda.Device.id
        value = getattr(device, attr, None)
        if isinstance(value, int):
            return value
    return 0
