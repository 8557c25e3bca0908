"""The master's table of federating clients' peer reports (pure)."""

from __future__ import annotations

from kvconnect.store import messages as m
from kvconnect.store.master.peers import MAX_NAME_BYTES, PeerReports


def _use(peer: str, *, up: bool = True, asked: int = 0, hits: int = 0) -> m.PeerUse:
    return m.PeerUse(peer, f"tcp://{peer}:1", up, m.PeerCounts(asked, hits, hits * 10, 1, 2, 3))


def _report(client: str, home_hits: int, *uses: m.PeerUse) -> m.PeerReport:
    return m.PeerReport(client, home_hits, list(uses))


def test_reports_sum_per_peer_with_each_clients_reads_for_the_hit_share() -> None:
    reports = PeerReports()
    assert reports.record(0, _report("a", 60, _use("east", asked=50, hits=40)), 0.0) is m.Code.OK
    two = _report("b", 10, _use("east", up=False, asked=5, hits=0), _use("west", hits=30))
    assert reports.record(0, two, 0.0) is m.Code.OK
    east, west = reports.summary(1.0)
    reads = (60 + 40) + (10 + 0 + 30)  # each client's home hits and every peer's
    assert east == m.PeerSummary(
        "east",
        "tcp://east:1",
        clients=2,
        down=1,
        reads=reads,
        counts=m.PeerCounts(55, 40, 400, 2, 4, 6),
    )
    assert (west.clients, west.down, west.counts.hits, west.reads) == (1, 0, 30, 40)


def test_a_clients_new_report_replaces_its_last() -> None:
    reports = PeerReports()
    reports.record(0, _report("a", 1, _use("east", hits=1)), 0.0)
    (east,) = reports.summary(0.5)
    assert (east.clients, east.counts.hits, east.reads) == (1, 1, 2)
    reports.record(0, _report("a", 5, _use("east", hits=7)), 1.0)
    (east,) = reports.summary(1.0)
    assert (east.clients, east.counts.hits, east.reads) == (1, 7, 12)


def test_reports_expire_and_the_table_is_bounded() -> None:
    reports = PeerReports(ttl=30.0, capacity=3)
    reports.record(0, _report("old", 0, _use("east")), 0.0)
    for n in range(5):
        reports.record(0, _report(f"c{n}", 0, _use("west")), 20.0 + n)
    (west,) = reports.summary(25.0)  # "old" expired; of c0..c4 the three latest are kept
    assert west.clients == 3
    assert reports.summary(60.0) == []


def test_a_tenants_clients_are_shown_to_it_and_to_the_cluster_only() -> None:
    reports = PeerReports()
    reports.record(1, _report("x", 0, _use("east", hits=3)), 0.0)
    reports.record(2, _report("x", 0, _use("west", hits=4)), 0.0)  # same id, other tenant
    assert [p.peer for p in reports.summary(0.0)] == ["east", "west"]
    assert [p.peer for p in reports.summary(0.0, tenant=1)] == ["east"]
    assert [(p.peer, p.counts.hits) for p in reports.summary(0.0, tenant=2)] == [("west", 4)]
    assert reports.summary(0.0, tenant=3) == []


def test_malformed_reports_are_refused_and_change_nothing() -> None:
    reports = PeerReports()
    reports.record(0, _report("a", 1, _use("east", hits=1)), 0.0)
    hostile = [
        _report("b", -1, _use("east")),
        _report("b", 0, m.PeerUse("east", "tcp://e:1", True, m.PeerCounts(asked=-5))),
        _report("b", 0, *[_use(f"p{n}") for n in range(m.MAX_PEERS + 1)]),
        _report("b" * (MAX_NAME_BYTES + 1), 0, _use("east")),
        _report("b", 0, _use("")),
        _report("", 0, _use("east")),
        _report("b", 0, _use("east"), _use("east")),
    ]
    for report in hostile:
        refused = reports.record(0, report, 0.0)
        assert isinstance(refused, m.Error)
        assert refused.code is m.Code.INVALID
    (east,) = reports.summary(0.0)
    assert (east.clients, east.counts.hits) == (1, 1)
