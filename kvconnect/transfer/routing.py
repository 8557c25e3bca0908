"""Which transport serves a request: pure logic, no I/O, decided from capabilities alone."""

from __future__ import annotations

from collections.abc import Mapping

from kvconnect.errors import InvalidRequest
from kvconnect.transfer.config import TransportName
from kvconnect.transfer.memory import MemoryKind
from kvconnect.transfer.segment import RegionInfo, SegmentDescriptor
from kvconnect.transfer.types import Capabilities


def unreachable(
    capabilities: Capabilities, me: SegmentDescriptor, peer: SegmentDescriptor, region: RegionInfo
) -> str | None:
    """Why a transport with ``capabilities`` cannot reach ``region`` of ``peer``; None if it can."""
    if capabilities.same_process_only and peer.process_id != me.process_id:
        return f"{peer.name} is in another process"
    if capabilities.same_host_only and peer.host_id != me.host_id:
        return f"{peer.name} is on another host"
    endpoint = capabilities.endpoint
    if endpoint is not None:
        if capabilities.both_ends and endpoint not in me.endpoints:
            return f"this engine has no {capabilities.endpoint_label}"
        if endpoint not in peer.endpoints:
            return f"{peer.name} offers no {capabilities.endpoint_label}"
    if capabilities.memory_only and region.kind == MemoryKind.FILE.value:
        return f"{peer.name} region {region.id} is a FILE region (served over TCP)"
    if capabilities.shared_regions_only and not region.shareable:
        return (
            f"{peer.name} region {region.id} is not shared memory "
            "(allocate it with engine.allocate)"
        )
    return None


def choose_transport(
    mode: TransportName,
    me: SegmentDescriptor,
    peer: SegmentDescriptor,
    region: RegionInfo,
    transports: Mapping[str, Capabilities],
) -> str:
    """The name of the transport that serves an access to ``region`` of ``peer``.

    ``transports``: the capabilities of the transports this engine runs, most preferred first
    (the registry's order: local → shm → rdma → tcp). ``auto`` picks the first that reaches
    the region; any other mode forces that transport and raises InvalidRequest naming the
    reason when it cannot reach the region.
    """
    if mode == "auto":
        for name, capabilities in transports.items():
            if unreachable(capabilities, me, peer, region) is None:
                return name
        raise InvalidRequest(f"no transport of this engine reaches {peer.name} region {region.id}")
    forced = transports.get(mode)
    reason = (
        "this engine does not run it" if forced is None else unreachable(forced, me, peer, region)
    )
    if reason is not None:
        raise InvalidRequest(f"transport '{mode}' is forced but {reason}")
    return mode
