"""Routing (pure): which transport serves a request, from capabilities and descriptors alone."""

from __future__ import annotations

import pytest

from kvconnect.errors import InvalidRequest
from kvconnect.transfer import Capabilities
from kvconnect.transfer.routing import choose_transport
from kvconnect.transfer.segment import RegionInfo, SegmentDescriptor
from kvconnect.transfer.transports import registry
from kvconnect.transfer.transports.local import LocalTransport
from kvconnect.transfer.transports.rdma.transport import RdmaTransport
from kvconnect.transfer.transports.shm import ShmTransport
from kvconnect.transfer.transports.tcp import TcpTransport

BUILTIN = {
    t.name: t.capabilities for t in (LocalTransport, ShmTransport, RdmaTransport, TcpTransport)
}


def test_the_registry_prefers_local_then_shm_then_rdma_then_tcp() -> None:
    assert [entry.name for entry in registry.entries()] == list(BUILTIN)


def _segment(host: str, process: str, endpoints: dict[str, str]) -> SegmentDescriptor:
    return SegmentDescriptor(
        name=f"{host}-{process}",
        engine_id=f"{host}{process}",
        process_id=process,
        host_id=host,
        endpoints=endpoints,
    )


SHARED = RegionInfo(1, 100, "host", True, True)
PRIVATE = RegionInfo(2, 100, "host", True, False)
ME = _segment("h1", "p1", {"tcp": "a:1", "shm": "@a"})
SAME_PROCESS = _segment("h1", "p1", {"tcp": "a:2", "shm": "@b"})
SAME_HOST = _segment("h1", "p2", {"tcp": "a:3", "shm": "@c"})
NO_SHM = _segment("h1", "p3", {"tcp": "a:4"})
OTHER_HOST = _segment("h2", "p9", {"tcp": "b:1", "shm": "@d"})


@pytest.mark.parametrize(
    ("mode", "peer", "region", "expected"),
    [
        ("auto", SAME_PROCESS, PRIVATE, "local"),
        ("auto", SAME_HOST, SHARED, "shm"),
        ("auto", SAME_HOST, PRIVATE, "tcp"),
        ("auto", NO_SHM, SHARED, "tcp"),
        ("auto", OTHER_HOST, SHARED, "tcp"),
        ("tcp", SAME_PROCESS, SHARED, "tcp"),
        ("shm", SAME_PROCESS, SHARED, "shm"),
        ("local", SAME_PROCESS, PRIVATE, "local"),
    ],
)
def test_routing(mode: str, peer: SegmentDescriptor, region: RegionInfo, expected: str) -> None:
    assert choose_transport(mode, ME, peer, region, BUILTIN) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "peer", "region", "reason"),
    [
        ("local", SAME_HOST, SHARED, "another process"),
        ("shm", OTHER_HOST, SHARED, "another host"),
        ("shm", NO_SHM, SHARED, "no shared-memory endpoint"),
        ("shm", SAME_HOST, PRIVATE, "allocate it with engine.allocate"),
    ],
)
def test_forced_routing_that_cannot_work_says_why(
    mode: str, peer: SegmentDescriptor, region: RegionInfo, reason: str
) -> None:
    with pytest.raises(InvalidRequest, match=reason):
        choose_transport(mode, ME, peer, region, BUILTIN)  # type: ignore[arg-type]


def _descriptor(process: str, host: str, endpoints: dict[str, str]) -> SegmentDescriptor:
    return SegmentDescriptor(
        name=process, engine_id=process, process_id=process, host_id=host, endpoints=endpoints
    )


FILE = RegionInfo(3, 100, "file", False, False)


@pytest.mark.parametrize(
    ("peer", "expected"), [(SAME_PROCESS, "local"), (SAME_HOST, "tcp"), (OTHER_HOST, "tcp")]
)
def test_file_regions_are_reached_only_by_transports_that_ask_their_owner(
    peer: SegmentDescriptor, expected: str
) -> None:
    me = _segment("h1", "p1", {"tcp": "a:1", "shm": "@a", "rdma": "mlx5_0"})
    with_rdma = _segment(peer.host_id, peer.process_id, {**peer.endpoints, "rdma": "mlx5_1"})
    assert choose_transport("auto", me, with_rdma, FILE, BUILTIN) == expected
    for forced in ("rdma",) if peer is OTHER_HOST else ("shm", "rdma"):
        with pytest.raises(InvalidRequest, match="region 3 is a FILE region"):
            choose_transport(forced, me, with_rdma, FILE, BUILTIN)  # type: ignore[arg-type]


def test_routing_prefers_rdma_between_hosts_and_names_the_missing_side() -> None:
    region = RegionInfo(1, 4096, "host", True, False)
    me = _descriptor("a", "h1", {"tcp": "x:1", "rdma": "mlx5_0"})
    peer = _descriptor("b", "h2", {"tcp": "y:1", "rdma": "mlx5_0,mlx5_1"})
    plain = _descriptor("c", "h2", {"tcp": "z:1"})
    assert choose_transport("auto", me, peer, region, BUILTIN) == "rdma"
    assert choose_transport("auto", me, plain, region, BUILTIN) == "tcp"
    assert choose_transport("rdma", me, peer, region, BUILTIN) == "rdma"
    with pytest.raises(InvalidRequest, match="c offers no RDMA NIC"):
        choose_transport("rdma", me, plain, region, BUILTIN)
    with pytest.raises(InvalidRequest, match="this engine has no RDMA NIC"):
        choose_transport("rdma", plain, peer, region, BUILTIN)


def test_only_the_transports_the_engine_runs_are_chosen() -> None:
    without_rdma = {name: caps for name, caps in BUILTIN.items() if name != "rdma"}
    me = _segment("h1", "p1", {"tcp": "a:1", "rdma": "mlx5_0"})
    peer = _segment("h2", "p2", {"tcp": "b:1", "rdma": "mlx5_0"})
    assert choose_transport("auto", me, peer, PRIVATE, without_rdma) == "tcp"
    with pytest.raises(InvalidRequest, match="transport 'rdma' is forced but this engine does not"):
        choose_transport("rdma", me, peer, PRIVATE, without_rdma)


def test_a_plugged_in_transport_is_routed_by_its_capabilities_alone() -> None:
    fast = Capabilities(endpoint="fast", endpoint_label="fast link", same_host_only=True)
    transports = {"fast": fast, **BUILTIN}
    fast_peer = _segment("h1", "p2", {"tcp": "a:3", "fast": "f0"})
    assert choose_transport("auto", ME, fast_peer, PRIVATE, transports) == "fast"
    assert choose_transport("auto", ME, SAME_HOST, PRIVATE, transports) == "tcp"
    with pytest.raises(InvalidRequest, match="no transport of this engine reaches h1-p2 region 2"):
        choose_transport("auto", ME, SAME_HOST, PRIVATE, {"fast": fast})
