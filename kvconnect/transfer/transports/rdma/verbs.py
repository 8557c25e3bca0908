"""Thin layer over rdma-core's pyverbs: open NICs, register memory, build and drive RC QPs.

pyverbs is optional (Debian's ``python3-pyverbs``; the PyPI build does not match Debian's
rdma-core) and imported on first use only. Everything verbs-specific the transport needs lives
here, so ``rdma.py`` reads as transport logic.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import select
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvconnect.errors import BrokenError, ConfigError, RegistrationError
from kvconnect.transfer.memory import MemoryKind, MemoryRegion
from kvconnect.transfer.protocol.wire import RdmaPath
from kvconnect.transfer.transports.rdma.plan import RD_ATOMIC, QpState, QpStep

log = logging.getLogger(__name__)

PORT: Final = 1
_IPV4_MAPPED: Final = bytes(10) + b"\xff\xff"
_CQ_DEPTH: Final = 4096
_FD_LOCK = threading.Lock()  # channel fds are found by diffing /proc/self/fd (see _new_fd)
_CU_DMABUF_FD: Final = 1  # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
_PAGE: Final = os.sysconf("SC_PAGE_SIZE")
WC_SUCCESS: Final = 0  # ibv_wc_status values (kernel ABI, stable)
WC_FLUSH: Final = 5
WC_REM_ACCESS: Final = 10

# pyverbs modules, bound by load(); typed loosely (pyverbs ships no stubs).
e: Any = None
_v: dict[str, Any] = {}


def load() -> None:
    """Import pyverbs (once). Raises ImportError when it is not installed."""
    global e  # noqa: PLW0603 - bound on first use so hosts without pyverbs never import it
    if e is not None:
        return
    try:  # rdma-core >= 59 moved the enums
        import pyverbs.libibverbs_enums as enums
    except ImportError:
        from pyverbs import enums
    from pyverbs.addr import AHAttr, GlobalRoute
    from pyverbs.cq import CQ, CompChannel
    from pyverbs.device import Context, get_device_list
    from pyverbs.mr import MR, DmaBufMR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR

    _v.update(
        AHAttr=AHAttr, GlobalRoute=GlobalRoute, CQ=CQ, CompChannel=CompChannel, Context=Context,
        get_device_list=get_device_list, MR=MR, DmaBufMR=DmaBufMR, PD=PD, QP=QP, QPAttr=QPAttr,
        QPCap=QPCap, QPInitAttr=QPInitAttr, SGE=SGE, SendWR=SendWR,
        errors=(PyverbsError, PyverbsRDMAError),
    )  # fmt: skip
    e = enums


def device_names() -> list[str]:
    """Names of the RDMA devices present; [] without pyverbs or kernel RDMA support."""
    try:
        load()
        return sorted(d.name.decode() for d in _v["get_device_list"]())
    except ImportError:
        return []
    except _v["errors"]:  # no /sys/class/infiniband_verbs: the kernel has no RDMA
        return []


def verbs_errors() -> tuple[type[Exception], ...]:
    """pyverbs' exception types (after :func:`load`)."""
    return _v["errors"]  # type: ignore[no-any-return]


def full_access(writable: bool = True) -> int:
    """Access flags of an MR peers may read and (if ``writable``) write."""
    flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
    return int(flags | e.IBV_ACCESS_REMOTE_WRITE) if writable else int(e.IBV_ACCESS_REMOTE_READ)


@dataclass(frozen=True, slots=True)
class Registered:
    """An MR and the address of the region's first byte in the MR's address space (the virtual
    address for host and peer memory, an iova for dmabuf): work requests on both ends use it."""

    mr: Any
    base: int

    def close(self) -> None:
        """Deregister."""
        self.mr.close()


class Nic:
    """One open RDMA device: context, protection domain, one CQ with its completion channel."""

    def __init__(self, name: str, gid_index: int | None) -> None:
        """Open ``name``; raises BrokenError when its port is not active or has no usable GID."""
        self.name = name
        self.ctx = _v["Context"](name=name)
        try:
            port = self.ctx.query_port(PORT)
            if port.state != e.IBV_PORT_ACTIVE:
                raise BrokenError(f"{name} port {PORT} is not active")
            self.mtu = int(port.active_mtu)
            self.gid_index = (
                _pick_gid(self.ctx, port.gid_tbl_len) if gid_index is None else gid_index
            )
            self.gid = _gid_bytes(self.ctx.query_gid(PORT, self.gid_index))
            attr = self.ctx.query_device()
            self.rd_atomic = max(
                1, min(RD_ATOMIC, int(attr.max_qp_rd_atom), int(attr.max_qp_init_rd_atom))
            )
            self.pd = _v["PD"](self.ctx)
            with _FD_LOCK:
                before = _fds()
                self.channel = _v["CompChannel"](self.ctx)
                self.channel_fd = _new_fd(before)
            if self.channel_fd < 0:
                log.warning("completion channel fd of %s not found: polling every 1 ms", name)
            self.cq = _v["CQ"](self.ctx, _CQ_DEPTH, None, self.channel, 0)
        except BaseException:
            self.ctx.close()
            raise

    def register(self, region: MemoryRegion) -> Registered:
        """An MR over ``region`` (host: its pages; CUDA: dmabuf, else peer memory)."""
        access = full_access(region.writable)
        start = time.perf_counter()
        try:
            if region.kind is MemoryKind.CUDA:
                registered = _register_cuda(self.pd, region, access)
            else:
                mr = _v["MR"](self.pd, region.length, access, address=region.address)
                registered = Registered(mr, region.address)
        except _v["errors"] as exc:
            raise RegistrationError(
                f"cannot register region {region.id} ({region.length} bytes) on {self.name}: {exc}"
            ) from exc
        log.debug(
            "registered region %d (%d bytes) on %s in %.3f s",
            region.id, region.length, self.name, time.perf_counter() - start,
        )  # fmt: skip
        return registered

    def create_qp(self, max_wr: int, inline_bytes: int) -> Any:
        """A new RC QP in RESET on this NIC's CQ (every work request signalled)."""
        cap = _v["QPCap"](
            max_send_wr=max_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1,
            max_inline_data=inline_bytes,
        )  # fmt: skip
        init = _v["QPInitAttr"](
            qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1
        )
        return _v["QP"](self.pd, init)

    def endpoint(self, qp: Any, slot: int, peer_nic: str) -> RdmaPath:
        """What the far end needs to connect to ``qp`` (a fresh random PSN)."""
        psn = random.getrandbits(24)
        return RdmaPath(slot, self.name, peer_nic, self.gid, int(qp.qp_num), psn, self.mtu)

    def apply(self, qp: Any, step: QpStep) -> None:
        """Perform one QP state transition (see rdma_plan.connect_steps)."""
        attr = _v["QPAttr"](qp_state=_STATE[step.state](), cur_qp_state=e.IBV_QPS_RESET)
        for name, value in step.fields.items():
            setattr(attr, name, value)
        if step.av is not None:
            route = _v["GlobalRoute"](
                dgid=_gid_object(step.av.dgid),
                sgid_index=step.av.sgid_index,
                hop_limit=step.av.hop_limit,
            )
            attr.ah_attr = _v["AHAttr"](port_num=step.av.port, is_global=1, gr=route)
        mask = 0
        for name in step.mask:
            mask |= getattr(e, f"IBV_QP_{name}")
        qp.modify(attr, mask)

    def post(
        self,
        qp: Any,
        wr_id: int,
        opcode: int,
        local: tuple[int, int, int],
        remote: tuple[int, int],
        inline: bool,
    ) -> None:
        """Post one signalled RDMA READ/WRITE: ``local`` (address, length, lkey) ⇄ ``remote``
        (rkey, address). Raises a pyverbs error when the QP refuses it."""
        flags = e.IBV_SEND_SIGNALED | (e.IBV_SEND_INLINE if inline else 0)
        sge = _v["SGE"](*local)
        wr = _v["SendWR"](wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=flags)
        wr.set_wr_rdma(*remote)
        qp.post_send(wr)

    def poll(self, count: int) -> list[Any]:
        """Up to ``count`` work completions, without waiting."""
        n, wcs = self.cq.poll(count)
        return list(wcs[:n]) if n > 0 else []

    def arm(self) -> None:
        """Ask for a completion event on the next completion."""
        self.cq.req_notify()

    def take_event(self) -> None:
        """Consume and acknowledge the pending completion event (the fd was readable)."""
        self.channel.get_cq_event(self.cq)
        self.cq.ack_events(1)

    def close(self) -> None:
        """Destroy the CQ, channel, PD and context (QPs and MRs first, by their owners)."""
        for obj in (self.cq, self.channel, self.pd, self.ctx):
            with contextlib.suppress(*_v["errors"]):
                obj.close()


def wait_events(nics: Sequence[Nic], timeout: float) -> list[Nic]:
    """Block until a completion event is pending on some NIC's channel (at most ``timeout``).

    Channels whose fd could not be found are polled by the caller instead.
    """
    poller = select.poll()
    by_fd = {nic.channel_fd: nic for nic in nics if nic.channel_fd >= 0}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    if not by_fd:
        time.sleep(min(timeout, 0.001))
        return []
    return [by_fd[fd] for fd, _ in poller.poll(timeout * 1000)]


def opcode(write: bool) -> int:
    """The verbs opcode of an RDMA WRITE or READ."""
    return int(e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ)


def wc_status_name(status: int) -> str:
    """``IBV_WC_...`` name of a completion status."""
    for name in dir(e):
        if name.startswith("IBV_WC_") and name.endswith("_ERR") and getattr(e, name) == status:
            return name
    return f"status {status}"


_STATE = {
    QpState.INIT: lambda: e.IBV_QPS_INIT,
    QpState.RTR: lambda: e.IBV_QPS_RTR,
    QpState.RTS: lambda: e.IBV_QPS_RTS,
    QpState.ERR: lambda: e.IBV_QPS_ERR,
}


def _pick_gid(ctx: Any, table_len: int) -> int:
    """The RoCE v2 GID with an IPv4-mapped address, else any RoCE v2 GID, else index 0 (IB).

    Indices differ between hosts and change with addresses: never hard-code them.
    """
    roce_v2 = []
    for index in range(table_len):
        try:
            entry = ctx.query_gid_ex(PORT, index)
            gid = _gid_bytes(ctx.query_gid(PORT, index))
        except _v["errors"]:
            continue
        if entry.gid_type == e.IBV_GID_TYPE_ROCE_V2 and any(gid):
            if gid.startswith(_IPV4_MAPPED):
                return index
            roce_v2.append(index)
    return roce_v2[0] if roce_v2 else 0


def _gid_bytes(gid: Any) -> bytes:
    return bytes.fromhex(str(gid).replace(":", ""))


def _gid_object(raw: bytes) -> Any:
    from pyverbs.addr import GID

    text = raw.hex()
    return GID(":".join(text[i : i + 4] for i in range(0, 32, 4)))


def _fds() -> dict[int, str]:
    """Open fds and what they point to (listdir's own fd included: compare targets, not
    numbers, or an fd reused by the channel looks old)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return out


def _new_fd(before: dict[int, str]) -> int:
    """The completion channel's fd: pyverbs does not expose it, but it is the one new
    ``infinibandevent`` fd. Waiting on it with poll() keeps every wait bounded (pyverbs'
    get_cq_event blocks without a timeout). -1 if it cannot be told apart."""
    found = [
        fd
        for fd, target in _fds().items()
        if "infinibandevent" in target and before.get(fd) != target
    ]
    return found[0] if len(found) == 1 else -1


def _register_cuda(pd: Any, region: MemoryRegion, access: int) -> Registered:
    """GPU memory: a dmabuf MR when the driver exports one, else peer memory (nvidia-peermem).

    A dmabuf must cover whole host pages, so the range is widened to page bounds; pyverbs
    registers it at iova = the offset given (0), so the region starts at iova ``address -
    start`` and that is what both ends put in work requests.
    """
    start = region.address - region.address % _PAGE
    end = -(-(region.address + region.length) // _PAGE) * _PAGE
    fd = _cuda_dmabuf_fd(start, end - start)
    if fd is None:
        mr = _v["MR"](pd, region.length, access, address=region.address)
        return Registered(mr, region.address)
    try:
        mr = _v["DmaBufMR"](pd, end - start, access, dmabuf=fd, offset=0)
    finally:
        os.close(fd)
    return Registered(mr, region.address - start)


def _cuda_dmabuf_fd(address: int, length: int) -> int | None:
    """A dmabuf fd for a device range (CUDA ≥ 11.7 driver with dmabuf support), else None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise ConfigError("registering CUDA memory for RDMA needs the CUDA driver") from None
    get_handle = getattr(lib, "cuMemGetHandleForAddressRange", None)
    if get_handle is None:
        return None
    fd = ctypes.c_int(-1)
    get_handle.argtypes = [
        ctypes.POINTER(ctypes.c_int), ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int,
        ctypes.c_ulonglong,
    ]  # fmt: skip
    status = get_handle(ctypes.byref(fd), address, length, _CU_DMABUF_FD, 0)
    return fd.value if status == 0 and fd.value >= 0 else None
