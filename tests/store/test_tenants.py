"""Tenants at the master, pure: how a tenant's requests are scoped, and quotas, shares and
eviction in the state machine (no processes; the cluster tests run them for real)."""

from __future__ import annotations

import pytest

from kvconnect._config import tenant_token
from kvconnect.errors import ConfigError
from kvconnect.store import messages as m
from kvconnect.store.config import MasterConfig, TenantConfig
from kvconnect.store.master import tenants as t
from kvconnect.store.master.state import MasterState

KiB = 1024
MiB = 1024 * KiB


def test_a_tenants_keys_live_under_its_prefix_and_invalid_keys_stay_invalid() -> None:
    request = t.scoped(m.Exists(["a", "", "x\0y"]), "team-a")
    assert isinstance(request, m.Exists)
    assert request.keys[:2] == ["\x1dteam-a\x1da", ""]
    assert not m.check_key(request.keys[2], m.MAX_STORED_KEY_BYTES)  # NUL: refused still
    put = t.scoped(m.PutStart("c", [m.PutItem("a", 10, 1)], 1, ""), "team-a")
    assert isinstance(put, m.PutStart)
    assert put.items[0].key == "\x1dteam-a\x1da"
    listing = t.scoped(m.Removals("sglang/", 5, 10), "team-a")
    assert isinstance(listing, m.Removals)
    assert (listing.prefix, listing.since, listing.limit) == ("\x1dteam-a\x1dsglang/", 5, 10)
    for admin in (m.Heartbeat("s", [], []), m.Unmount("s", [])):
        denied = t.scoped(admin, "team-a")
        assert isinstance(denied, m.Error)
        assert denied.code is m.Code.DENIED
    too_long = t.scoped(m.Removals("p" * 1025), "team-a")
    assert isinstance(too_long, m.Error)
    assert too_long.code is m.Code.INVALID
    reply = m.RemovalsReply(
        1, 0, 3, [m.Removal(3, "\x1dteam-a\x1dsglang/x", m.RemovalReason.EVICTED)]
    )
    shown = t.unscoped(reply, "team-a")
    assert isinstance(shown, m.RemovalsReply)
    assert [r.key for r in shown.removed] == ["sglang/x"]


def test_stored_keys_tell_their_tenant() -> None:
    tenants = t.Tenants([TenantConfig(name="a", quota=10), TenantConfig(name="b")])
    assert tenants.id_of_key("\x1da\x1dkey") == 1
    assert tenants.id_of_key("\x1db\x1dkey") == 2
    assert tenants.id_of_key("\x1dz\x1dkey") == t.NONE  # not a tenant
    assert tenants.id_of_key("plain") == t.NONE
    assert (tenants.quota(1), tenants.share(1), tenants.quota(2), tenants.share(2)) == (
        10,
        10,
        0,
        0,
    )


def test_tenant_tokens_derive_from_the_cluster_token_and_differ() -> None:
    a, b = tenant_token("root", "a"), tenant_token("root", "b")
    assert len({a, b, tenant_token("other-root", "a")}) == 3
    assert a == tenant_token("root", "a")
    with pytest.raises(ConfigError, match="unique"):
        MasterConfig.from_mapping({"tenants": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ConfigError, match="name"):
        TenantConfig.from_mapping({"name": "a/b"})


def _state(*tenants: TenantConfig, segment: int = 16 * MiB) -> MasterState:
    config = MasterConfig(tenants=tenants, alignment=64, eviction_step=64, high_watermark=0.9)
    state = MasterState(config, seed=1)
    spec = m.SegmentSpec(name="seg", engine_segment="e", region=1, size=segment, host_id="h")
    assert state.mount("server", "mount", spec, 0.0) is m.Code.OK
    return state


def _put(state: MasterState, tenant: int, keys: list[str], size: int, now: float) -> list[m.Code]:
    items = [m.PutItem(key, size, 1) for key in keys]
    placed = state.put_start("c", items, 1, "h", False, now, tenant)
    done = [(p.put, item.key) for p, item in zip(placed, items, strict=True) if p.code is m.Code.OK]
    if done:
        state.put_end([k for _, k in done], [0] * len(done), [p for p, _ in done], now)
    return [p.code for p in placed]


def _key(tenant: str, name: str) -> str:
    return t.prefix(tenant) + name


def test_a_put_over_the_quota_evicts_the_tenants_own_oldest_objects_only() -> None:
    state = _state(TenantConfig(name="noisy", quota=1 * MiB), TenantConfig(name="calm"))
    calm = [_key("calm", f"c{i}") for i in range(4)]
    assert _put(state, 2, calm, 64 * KiB, 1.0) == [m.Code.OK] * 4
    noisy = [_key("noisy", f"n{i}") for i in range(16)]
    for i, key in enumerate(noisy):  # exactly its quota, oldest first
        assert _put(state, 1, [key], 64 * KiB, 2.0 + i / 100) == [m.Code.OK]
    more = [_key("noisy", f"m{i}") for i in range(4)]
    assert _put(state, 1, more, 64 * KiB, 3.0) == [m.Code.NO_SPACE] * 4
    state.tick(4.0)  # its eviction: its four oldest go
    assert state.exists(noisy) == [False] * 4 + [True] * 12
    assert _put(state, 1, more, 64 * KiB, 5.0) == [m.Code.OK] * 4
    assert state.exists(calm) == [True] * 4
    (noisy_stats, calm_stats) = state.tenant_stats()
    assert (noisy_stats.used, noisy_stats.objects, noisy_stats.evictions) == (MiB, 16, 4)
    assert (calm_stats.used, calm_stats.objects, calm_stats.evictions) == (256 * KiB, 4, 0)


def test_a_full_store_evicts_from_the_tenant_over_its_share_first() -> None:
    state = _state(
        TenantConfig(name="big", share=2 * MiB),
        TenantConfig(name="small", share=2 * MiB),
        segment=8 * MiB,
    )
    small = [_key("small", f"s{i}") for i in range(16)]  # 1 MiB: within its share
    assert _put(state, 2, small, 64 * KiB, 1.0) == [m.Code.OK] * 16
    big = [_key("big", f"b{i}") for i in range(200)]
    now = 2.0
    for i in range(0, 200, 8):  # 12.5 MiB into 8 MiB: eviction runs between the puts
        _put(state, 1, big[i : i + 8], 64 * KiB, now)
        now += 0.01
        for _ in range(4):
            state.tick(now)
    assert state.exists(small) == [True] * 16, "the tenant within its share kept everything"
    stats = {s.name: s for s in state.tenant_stats()}
    assert stats["big"].evictions > 0
    assert stats["small"].evictions == 0


def test_a_memory_quota_demotes_to_disk_and_a_disk_quota_drops_the_oldest_there() -> None:
    tenant = TenantConfig(name="t", quota=512 * KiB, disk_quota=128 * KiB)
    state = _state(tenant)
    disk = m.SegmentSpec("seg-disk", "e", 2, 16 * MiB, "h", m.Tier.DISK)
    assert state.mount("server", "disk-mount", disk, 0.0) is m.Code.OK
    keys = [_key("t", f"k{i}") for i in range(8)]
    for i, key in enumerate(keys):  # its memory quota, oldest first
        assert _put(state, 1, [key], 64 * KiB, 1.0 + i / 100) == [m.Code.OK]
    more = [_key("t", f"m{i}") for i in range(4)]
    assert _put(state, 1, more, 64 * KiB, 2.0) == [m.Code.NO_SPACE] * 4
    state.tick(3.0)  # its four oldest leave memory: demoted to the server's disk
    moves = list(state.objects.moves.items())
    assert sorted(move.key for _target, move in moves) == keys[:4]
    done = [m.Moved(move.key, target.offset) for target, move in moves]
    state.heartbeat("server", [], [], 3.5, [m.TierReport("disk-mount", done=done)])
    (stats,) = state.tenant_stats()
    assert (stats.used, stats.disk_used) == (256 * KiB, 256 * KiB)
    state.tick(4.0)  # over its disk quota by two objects: the two oldest there go
    assert state.exists(keys) == [False] * 2 + [True] * 6
    (stats,) = state.tenant_stats()
    assert (stats.used, stats.disk_used, stats.evictions) == (256 * KiB, 128 * KiB, 2)
    assert _put(state, 1, more, 64 * KiB, 5.0) == [m.Code.OK] * 4
