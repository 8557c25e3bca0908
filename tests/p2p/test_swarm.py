"""The fetch scheduler's choices (pure: bitmaps in, assignments out, time passed in)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvconnect.p2p.swarm import (
    LONE_DEPTH,
    Assignment,
    Failure,
    Place,
    Proximity,
    Swarm,
    proximity,
)

N = 8


def bits(*chunks: int) -> np.ndarray:
    out = np.zeros(N, dtype=bool)
    out[list(chunks)] = True
    return out


ALL = np.ones(N, dtype=bool)
NONE = np.zeros(N, dtype=bool)


def swarm(per_holder: int = 1, seed: int = 0) -> Swarm:
    return Swarm(N, per_holder=per_holder, retry_after=2.0, seed=seed)


def test_proximity_same_host_then_place_then_any() -> None:
    me = Place("h1", "", "10.0.0.5")
    assert proximity(me, Place("h1", "", "10.9.9.9")) is Proximity.HOST
    assert proximity(me, Place("h2", "", "10.0.0.77")) is Proximity.PLACE  # same /24
    assert proximity(me, Place("h2", "", "10.0.1.77")) is Proximity.ANY
    rack = Place("h1", "rack-a", "10.0.0.5")._replace(host="h3")
    assert proximity(rack, Place("h2", "rack-a", "192.168.1.1")) is Proximity.PLACE
    assert proximity(rack, Place("h2", "rack-b", "10.0.0.6")) is Proximity.ANY  # named places win
    assert proximity(Place("a", "", "node1"), Place("b", "", "node1")) is Proximity.PLACE


def test_the_nearest_holder_serves_and_far_ones_only_what_it_lacks() -> None:
    s = swarm(per_holder=N)
    s.holder("far", Proximity.ANY, ALL, NONE)
    s.holder("host", Proximity.HOST, bits(0, 1, 2), NONE)
    taken = [s.next(0.0) for _ in range(N)]
    assert {a.chunk for a in taken if a and a.holder == "host"} == {0, 1, 2}
    assert [a.holder for a in taken[:3] if a] == ["host"] * 3  # near chunks go first
    assert {a.chunk for a in taken if a and a.holder == "far"} == set(range(3, N))


def test_rarest_chunks_first_counting_chunks_being_fetched() -> None:
    s = swarm(per_holder=N)
    s.holder("seed", Proximity.ANY, ALL, NONE)
    s.holder("a", Proximity.ANY, bits(0, 1, 2, 3), bits(4, 5))  # a fetches 4 and 5 now
    first = [s.next(0.0) for _ in range(2)]
    assert {a.chunk for a in first if a} == {6, 7}  # only the seed has them, nobody fetches them


def test_one_transfer_per_holder_spreads_the_load() -> None:
    s = swarm(per_holder=1)
    for name in ("x", "y", "z"):
        s.holder(name, Proximity.ANY, ALL, NONE)
    taken = [s.next(0.0) for _ in range(3)]
    assert sorted(a.holder for a in taken if a) == ["x", "y", "z"]
    assert s.next(0.0) is None  # every holder is busy
    first = taken[0]
    assert first is not None
    s.done(first)
    again = s.next(0.0)
    assert again is not None
    assert again.holder == first.holder
    assert s.in_flight() == 3
    assert s.missing == N - 1


def test_a_holder_no_one_else_reads_from_gets_two_transfers() -> None:
    s = swarm(per_holder=1)
    s.holder("publisher", Proximity.ANY, ALL, NONE)
    s.holder("idle", Proximity.ANY, NONE, NONE)  # a fetcher that has and fetches nothing yet
    pair = [s.next(0.0), s.next(0.0)]
    assert [a.holder for a in pair if a] == ["publisher", "publisher"]
    assert s.next(0.0) is None
    s.holder("idle", Proximity.ANY, NONE, bits(7))  # another fetcher is at work now
    first = pair[0]
    assert first is not None
    s.done(first)
    assert s.next(0.0) is None  # back to one transfer per holder: it has one under way


def test_a_failed_holder_rests_and_a_corrupt_one_is_never_asked_again() -> None:
    s = swarm()
    s.holder("bad", Proximity.HOST, ALL, NONE)
    s.holder("slow", Proximity.ANY, ALL, NONE)
    a = s.next(0.0)
    assert a is not None
    assert a.holder == "bad"
    s.failed(a, Failure.UNREACHABLE, now=10.0)
    b = s.next(10.0)
    assert b is not None
    assert b.holder == "slow"  # "bad" rests until 12
    s.failed(b, Failure.UNREACHABLE, now=10.0)
    assert s.next(11.0) is None  # both rest until 12
    c = s.next(12.0)
    assert c is not None
    assert c.holder == "bad"
    s.failed(c, Failure.CORRUPT, now=12.0)
    assert all(x is None or x.holder == "slow" for x in (s.next(100.0), s.next(100.0)))
    assert s.unavailable() == 0


def test_chunks_no_holder_has_are_unavailable_and_gone_holders_hold_nothing() -> None:
    s = swarm()
    s.have(0)
    s.holder("a", Proximity.ANY, bits(1, 2), NONE)
    assert s.missing == N - 1
    assert s.unavailable() == N - 3
    s.drop("a")
    assert s.unavailable() == N - 1
    assert s.next(0.0) is None


@given(
    holders=st.lists(st.lists(st.booleans(), min_size=N, max_size=N), min_size=1, max_size=5),
    per_holder=st.integers(1, 3),
    outcomes=st.lists(st.sampled_from(["done", "lost", "corrupt"]), max_size=60),
    seed=st.integers(0, 1000),
)
def test_invariants(
    holders: list[list[bool]], per_holder: int, outcomes: list[str], seed: int
) -> None:
    """Never a chunk twice in flight, never a holder over its limit or one that lacks the
    chunk, never a corrupt holder again; done chunks are never fetched again."""
    s = Swarm(N, per_holder=per_holder, retry_after=1.0, seed=seed)
    have = {f"h{i}": np.array(h, dtype=bool) for i, h in enumerate(holders)}
    for name, held in have.items():
        s.holder(name, Proximity.ANY, held, NONE)
    active = sum(bool(held.any()) for held in have.values())
    limit = per_holder if active > 1 else max(per_holder, LONE_DEPTH)
    flying: list[Assignment] = []
    done: set[int] = set()
    banned: set[str] = set()
    now = 0.0
    for outcome in outcomes:
        while (a := s.next(now)) is not None:
            assert have[a.holder][a.chunk]
            assert a.holder not in banned
            assert a.chunk not in done
            assert a.chunk not in {f.chunk for f in flying}
            flying.append(a)
            assert sum(f.holder == a.holder for f in flying) <= limit
        if not flying:
            now += 1.0
            continue
        a = flying.pop(0)
        if outcome == "done":
            s.done(a)
            done.add(a.chunk)
        else:
            s.failed(a, Failure.CORRUPT if outcome == "corrupt" else Failure.UNREACHABLE, now)
            if outcome == "corrupt":
                banned.add(a.holder)
    assert s.missing == N - len(done)
