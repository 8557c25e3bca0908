"""Which transport serves a request: pure logic, no I/O."""

from __future__ import annotations

from kvconnect.errors import InvalidRequest
from kvconnect.transfer.config import TransportName
from kvconnect.transfer.segment import RegionInfo, SegmentDescriptor


def choose_transport(
    mode: TransportName, me: SegmentDescriptor, peer: SegmentDescriptor, region: RegionInfo
) -> str:
    """Pick ``local``, ``shm``, ``rdma`` or ``tcp`` for an access to ``region`` of ``peer``.

    ``auto``: same process → local; same host and a shared region → shm; both ends with RDMA
    NICs → rdma; otherwise tcp. A forced mode that cannot reach the region raises
    InvalidRequest naming the reason.
    """
    same_process = peer.process_id == me.process_id
    shm_ok = peer.host_id == me.host_id and "shm" in peer.endpoints and region.shareable
    rdma_ok = "rdma" in me.endpoints and "rdma" in peer.endpoints
    if mode == "auto":
        if same_process:
            return "local"
        return "shm" if shm_ok else "rdma" if rdma_ok else "tcp"
    if mode == "rdma" and not rdma_ok:
        side = "this engine has" if "rdma" not in me.endpoints else f"{peer.name} offers"
        raise InvalidRequest(f"transport 'rdma' is forced but {side} no RDMA NIC")
    if mode == "local" and not same_process:
        raise InvalidRequest(f"transport 'local' is forced but {peer.name} is in another process")
    if mode == "shm" and not shm_ok:
        reason = (
            "is on another host"
            if peer.host_id != me.host_id
            else "offers no shared-memory endpoint"
            if "shm" not in peer.endpoints
            else f"region {region.id} is not shared memory (allocate it with engine.allocate)"
        )
        raise InvalidRequest(f"transport 'shm' is forced but {peer.name} {reason}")
    if mode == "tcp" and "tcp" not in peer.endpoints:
        raise InvalidRequest(f"transport 'tcp' is forced but {peer.name} has no TCP endpoint")
    return mode
