"""The connector's pure pieces: leases, kv_transfer_params, block layouts. These run
in every environment (no vLLM needed; torch for the tensor layouts)."""

from __future__ import annotations

import os
import threading

import msgspec
import pytest

from kvconnect.errors import ConfigError
from kvconnect.testing.vllm_servers import cpu_groups
from kvconnect.vllm.layout import (
    KVFormat,
    LayerLayout,
    RankLayout,
    block_runs,
    check_compatible,
    compat_hash,
    range_pairs,
)
from kvconnect.vllm.leases import Confirmation, LeaseTable
from kvconnect.vllm.params import prefill_params, remote_prefill


def test_a_read_is_confirmed_only_while_the_lease_holds() -> None:
    table = LeaseTable(duration=10)
    table.hold("a", readers=2, now=0)
    table.hold("b", readers=1, now=0)
    assert table.confirm("a", 0, now=5) is Confirmation.OK
    assert table.take_released() == [], "one of two readers is not enough"
    table.renew(["a"], now=9)
    assert table.confirm("b", 0, now=11) is Confirmation.EXPIRED, "b lapsed at 10"
    assert table.confirm("a", 1, now=18) is Confirmation.OK, "renewed at 9: holds until 19"
    assert sorted(table.take_released()) == ["a", "b"]
    assert table.expired == 1
    assert table.confirm("a", 1, now=18) is Confirmation.EXPIRED, "released is final"
    assert len(table) == 0


def test_give_up_releases_at_once_and_renewal_cannot_revive() -> None:
    table = LeaseTable(duration=1)
    table.hold("a", readers=1, now=0)
    table.hold("b", readers=1, now=0)
    table.give_up(["a", "unknown"])
    assert table.take_released() == ["a"]
    table.renew(["b"], now=5)  # too late: b lapsed at 1
    assert table.take_released() == ["b"]
    assert table.confirm("b", 0, now=5) is Confirmation.EXPIRED


def test_params_round_trip_and_tolerate_extra_keys() -> None:
    params = prefill_params(
        engine_id="e", request_id="r", host="h", port=5, block_ids=[3, 4], tp_size=2,
        num_tokens=40,
    )  # fmt: skip
    params["prompt_token_ids"] = [1, 2]  # added by vLLM's OpenAI layer
    remote = remote_prefill(params)
    assert remote is not None
    assert (remote.engine_id, remote.request_id, remote.endpoint) == ("e", "r", "tcp://h:5")
    assert (remote.block_ids, remote.tp_size, remote.num_tokens) == ((3, 4), 2, 40)
    params["remote_block_ids"] = [7, 8]  # older vLLM: one flat list
    assert remote_prefill(params).block_ids == (7, 8)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "change",
    [
        {"remote_port": "5"},
        {"remote_block_ids": []},
        {"remote_block_ids": [[1], [2]]},
        {"remote_host": ""},
        {"tp_size": -1},
    ],
)
def test_malformed_params_mean_computing_locally(change: dict[str, object]) -> None:
    params = prefill_params(
        engine_id="e", request_id="r", host="h", port=5, block_ids=[1], tp_size=1, num_tokens=1
    )
    assert remote_prefill(params | change) is None
    assert remote_prefill({"do_remote_decode": True}) is None


def test_block_runs_merge_what_is_consecutive_on_both_sides() -> None:
    assert block_runs([4, 5, 6, 9], [1, 2, 7, 8]) == [(4, 1, 2), (6, 7, 1), (9, 8, 1)]
    assert block_runs([], []) == []


def test_ranges_cover_every_chunk_of_every_block() -> None:
    # K and V outermost: chunk stride 1000, blocks of 10 bytes 10 apart (dense)
    local = LayerLayout("l", 1, 0, 2, 1000, 100, 10, 10)
    remote = LayerLayout("l", 7, 50, 2, 2000, 200, 10, 10)
    assert range_pairs(local, remote, [(4, 1, 2)]) == [(40, 60, 20), (1040, 2060, 20)]
    sparse = LayerLayout("l", 1, 0, 1, 0, 100, 16, 10)  # padded blocks: one range per block
    assert range_pairs(sparse, sparse, [(0, 2, 2)]) == [(0, 32, 10), (16, 48, 10)]


def test_kv_tensor_layouts_are_understood() -> None:
    torch = pytest.importorskip("torch")
    from kvconnect.vllm.kvcache import describe_layer

    kv_first = torch.zeros(2, 8, 16, 4, 64)  # [K|V, blocks, tokens, heads, dim] (flash)
    layer = describe_layer("a", kv_first, 1, 0, num_blocks=8)
    assert (layer.chunks, layer.block_bytes, layer.block_stride) == (2, 16 * 4 * 64 * 4, 16384)
    assert layer.chunk_stride == 8 * 16384
    blocks_first = torch.zeros(8, 2, 16, 64)  # [blocks, K|V, tokens, dim] (CPU)
    layer = describe_layer("b", blocks_first, 1, 0, num_blocks=8)
    assert (layer.chunks, layer.block_bytes) == (1, 2 * 16 * 64 * 4)
    with pytest.raises(ConfigError, match="contiguous"):
        describe_layer("c", torch.zeros(16, 8, 64).transpose(0, 1), 1, 0, num_blocks=8)
    # HND in memory behind NHD's shape (vLLM permutes strides): each block is still one range
    hnd = describe_layer("d", torch.zeros(2, 8, 4, 16, 64).transpose(2, 3), 1, 0, num_blocks=8)
    nhd = describe_layer("d", torch.zeros(2, 8, 16, 4, 64), 1, 0, num_blocks=8)
    assert (hnd.block_bytes, hnd.block_shape, hnd.dtype) == (
        nhd.block_bytes,
        (16, 4, 64),
        "torch.float32",
    )
    assert (hnd.block_strides, nhd.block_strides) == ((64, 1024, 1), (256, 64, 1))


def _rank(layer: LayerLayout, **changes: object) -> RankLayout:
    fmt = msgspec.structs.replace(
        KVFormat("vllm 0.33.0", "m", "", "auto/float16", 16, 1, "FLASH_ATTN", "NHD"), **changes
    )
    return RankLayout("segment", compat_hash(fmt, [layer, layer]), (layer, layer), fmt)


def test_compatibility_names_every_field_that_differs() -> None:
    torch = pytest.importorskip("torch")
    from kvconnect.vllm.kvcache import describe_layer

    nhd = describe_layer("l", torch.zeros(2, 8, 16, 4, 64), 1, 0, num_blocks=8)
    hnd = describe_layer("l", torch.zeros(2, 8, 4, 16, 64), 1, 0, num_blocks=8)
    mine = _rank(nhd)
    assert check_compatible(mine, _rank(nhd)) is None
    assert check_compatible(mine, msgspec.structs.replace(_rank(nhd), segment="other")) is None
    theirs = _rank(hnd, attention_backend="FLASHINFER")
    assert theirs.compat != mine.compat
    assert check_compatible(mine, theirs) == (
        "attention_backend: 'FLASHINFER' at the peer, 'FLASH_ATTN' here; "
        "layer l block_shape: (4, 16, 64) at the peer, (16, 4, 64) here; "
        "layer l block_strides: (1024, 64, 1) at the peer, (256, 64, 1) here; "
        "and 1 more layers differ"
    )
    for field, value in (("engine", "vllm 0.32.0"), ("revision", "abc"), ("kv_layout", "HND")):
        problem = check_compatible(mine, _rank(nhd, **{field: value}))
        assert problem is not None
        assert problem.startswith(f"{field}: {value!r} at the peer"), problem


class _Request:
    def __init__(self, rid: str, prompt: int, computed: int) -> None:
        self.request_id = rid
        self.kv_transfer_params = None
        self.num_prompt_tokens = prompt
        self.num_computed_tokens = computed
        self.block_hashes = [bytes([i]) * 4 for i in range(prompt // 4)]


class _Pool:
    def leading(self, hashes: object) -> int:
        return 0


def test_saves_are_planned_once_and_preempted_saves_are_protected() -> None:
    from kvconnect.vllm.scheduler import ConnectorScheduler

    scheduler = ConnectorScheduler(engine_id="e", host="h", tp_size=1, block_size=4, pool=_Pool())
    request = _Request("r", prompt=10, computed=4)
    scheduler.on_new_request(request)
    blocks = {"r": [7, 8, 9]}
    plan = scheduler.build_plan({"r": 3}, blocks.__getitem__)
    assert plan.save == (), "the prompt is not complete after this step"
    request.num_computed_tokens = 7
    plan = scheduler.build_plan({"r": 3}, blocks.__getitem__)
    (save,) = plan.save  # two full blocks of four tokens
    assert save.blocks == (7, 8)
    assert save.hashes == (b"\0\0\0\0".hex(), b"\1\1\1\1".hex())
    assert scheduler.build_plan({"r": 1}, blocks.__getitem__).save == (), "saved once"
    plan = scheduler.build_plan({}, blocks.__getitem__, preempted=["r", "other"])
    assert plan.preempted == ("r",)
    assert scheduler.request_finished(request, [7, 8, 9], completed=True) == (True, None)


def _affinity_of_threads(io_cpus: frozenset[int], model_core: int) -> list[set[int]]:
    """Affinity of a thread started under ``threads_on(io_cpus)`` by a thread pinned to
    ``model_core`` (as vLLM pins its CPU worker's model thread), then of that thread itself."""
    from kvconnect.vllm.affinity import threads_on

    seen: list[set[int]] = []

    def model_thread() -> None:
        os.sched_setaffinity(0, {model_core})
        with threads_on(io_cpus):
            child = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            child.start()
            child.join()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    return seen


def test_kvconnect_threads_inherit_the_model_threads_cores_unless_io_cpus_says() -> None:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        pytest.skip("needs two CPUs and sched_setaffinity")
    first, last = cpus[0], cpus[-1]
    assert _affinity_of_threads(frozenset(), first) == [{first}, {first}]
    assert _affinity_of_threads(frozenset({last}), first) == [{last}, {first}]


def test_io_cpus_the_process_cannot_use_are_a_config_error() -> None:
    from kvconnect.vllm.affinity import bind_this_thread

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs sched_setaffinity")
    with pytest.raises(ConfigError, match="io_cpus"):
        bind_this_thread(frozenset({100_000}))


def test_instances_on_one_host_get_disjoint_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4})
    assert cpu_groups(2) == ["0,1", "2,3"]
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {1})
    with pytest.raises(ValueError, match="2 groups need 2 cores"):
        cpu_groups(2)
