"""Prefill's lease table (kvconnect/vllm/leases.py): pure, every environment."""

from __future__ import annotations

from kvconnect.vllm.leases import Confirmation, LeaseTable


def test_a_read_is_confirmed_only_while_the_lease_holds() -> None:
    table = LeaseTable(duration=10)
    table.hold("a", now=0)
    table.hold("b", now=0)
    assert table.confirm("a", 0, 2, now=5) is Confirmation.OK
    assert table.take_released() == [], "one of two readers is not enough"
    table.renew(["a"], now=9)
    assert table.confirm("b", 0, 1, now=11) is Confirmation.EXPIRED, "b lapsed at 10"
    assert table.confirm("a", 1, 2, now=18) is Confirmation.OK, "renewed at 9: holds until 19"
    assert sorted(table.take_released()) == ["a", "b"]
    assert table.expired == 1
    assert table.confirm("a", 1, 2, now=18) is Confirmation.EXPIRED, "released is final"
    assert len(table) == 0


def test_give_up_releases_at_once_and_renewal_cannot_revive() -> None:
    table = LeaseTable(duration=1)
    table.hold("a", now=0)
    table.hold("b", now=0)
    table.give_up(["a", "unknown"])
    assert table.take_released() == ["a"]
    table.renew(["b"], now=5)  # too late: b lapsed at 1
    assert table.take_released() == ["b"]
    assert table.confirm("b", 0, 1, now=5) is Confirmation.EXPIRED


def test_decode_says_how_many_ranks_read_and_the_last_of_them_releases() -> None:
    # Prefill cannot know decode's TP size: every confirmation names it; one that names
    # fewer readers than another does not release early.
    table = LeaseTable(duration=10)
    table.hold("a", now=0)
    assert table.confirm("a", 3, 4, now=1) is Confirmation.OK
    assert table.confirm("a", 0, 2, now=1) is Confirmation.OK
    assert table.confirm("a", 1, 4, now=1) is Confirmation.OK
    assert table.confirm("a", 1, 4, now=1) is Confirmation.OK, "a repeated reader counts once"
    assert table.take_released() == []
    assert table.confirm("a", 2, 4, now=1) is Confirmation.OK
    assert table.take_released() == ["a"]
