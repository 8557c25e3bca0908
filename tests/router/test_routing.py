"""The routing composition without servers: KV events into the index, requests into
candidates, the fleet's health into the index (kvconnect/router/routing.py)."""

from __future__ import annotations

from typing import cast

import aiohttp

from kvconnect.router.config import RouterConfig
from kvconnect.router.instances import Fleet
from kvconnect.router.routing import STORE, Router
from kvconnect.router.types import Role
from kvconnect.store.kvevents import (
    OWNERSHIP_KVCONNECT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

A, B, U, D = "http://a:1", "http://b:1", "http://u:1", "http://d:1"
BLOCK = 4
PROMPT = list(range(100, 100 + 3 * BLOCK + 2))  # three full blocks and a partial one


def _router(**settings: object) -> tuple[Router, Fleet]:
    fleet = {"prefill": (A, B), "decode": (D,), "policy": "cache", **settings}
    config = RouterConfig(block_size=BLOCK, **fleet)  # type: ignore[arg-type]
    # The router does no I/O: the fleet's session is never used here.
    fleet = Fleet(
        config.roles(),
        cast(aiohttp.ClientSession, None),
        interval=1.0,
        timeout=1.0,
        unhealthy_after=2,
    )
    router = Router(config, fleet)
    for instance in fleet.instances():
        instance.healthy = True
    return router, fleet


def _stored(
    tokens: list[int], *, first: int = 0, lora: str | None = None, **fields: object
) -> BlockStored:
    count = len(tokens) // BLOCK
    return BlockStored(
        block_hashes=[first + n for n in range(count)],
        parent_block_hash=None,
        token_ids=tokens[: count * BLOCK],
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=lora,
        **fields,  # type: ignore[arg-type]
    )


def _batch(*events: KVEvent) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))


def _cached(router: Router, tokens: list[int], model: str = "m") -> dict[str, int]:
    request = router.request(tokens, model)
    return {c.name: c.cached_blocks for c in router.candidates(request, [Role.PREFILL])}


def test_an_instances_events_make_it_the_cached_candidate_and_the_choice() -> None:
    router, _ = _router()
    router.apply_events(A, _batch(_stored(PROMPT)))
    assert _cached(router, PROMPT) == {A: 3, B: 0}
    assert _cached(router, PROMPT[: 2 * BLOCK]) == {A: 2, B: 0}
    assert _cached(router, [7, *PROMPT]) == {A: 0, B: 0}  # another prefix
    request = router.request(PROMPT, "m")
    first = router.first_hop(request)
    assert first is not None
    assert (first.instance, first.cached_blocks) == (A, 3)
    assert router.estimate(request, first).compute_tokens == 2


def test_an_instance_that_goes_out_leaves_the_index_and_the_candidates() -> None:
    router, fleet = _router()
    router.apply_events(A, _batch(_stored(PROMPT)))
    router.apply_events(B, _batch(_stored(PROMPT, first=100)))
    entries = router.index_entries()
    fleet.failed(A, "connection refused")
    assert router.index_entries() == entries - 3
    assert _cached(router, PROMPT) == {B: 3}


def test_removed_cleared_and_publisher_resets_forget_blocks() -> None:
    router, _ = _router()
    router.apply_events(A, _batch(_stored(PROMPT)))
    router.apply_events(A, _batch(BlockRemoved(block_hashes=[2], medium="GPU")))
    assert _cached(router, PROMPT)[A] == 2
    router.apply_events(A, _batch(AllBlocksCleared()))
    assert _cached(router, PROMPT)[A] == 0
    router.apply_events(A, _batch(_stored(PROMPT)))
    router.publisher_reset(A)
    assert _cached(router, PROMPT)[A] == 0


def test_other_groups_and_other_block_sizes_are_skipped() -> None:
    router, _ = _router()
    router.apply_events(A, _batch(_stored(PROMPT, group_idx=1)))
    wrong = _stored(PROMPT)
    router.apply_events(
        A,
        _batch(
            BlockStored(
                block_hashes=wrong.block_hashes[:1],
                parent_block_hash=None,
                token_ids=wrong.token_ids[: 2 * BLOCK],
                block_size=2 * BLOCK,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ),
    )
    assert router.index_entries() == 0


def test_the_pool_from_kvconnect_events_and_from_the_store() -> None:
    router, _ = _router()
    router.apply_events(A, _batch(_stored(PROMPT[: 2 * BLOCK], ownership=OWNERSHIP_KVCONNECT)))
    assert router.request(PROMPT, "m").pool_blocks == 2
    assert _cached(router, PROMPT) == {A: 0, B: 0}  # the pool is no instance's own cache
    router.apply_events(B, _batch(_stored(PROMPT, first=50)))
    hashes = [50, 51, 52]  # the store announces B's hashes: now in the pool too
    router.apply_events(
        STORE,
        _batch(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=[],
                block_size=BLOCK,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            )
        ),
    )
    assert router.request(PROMPT, "m").pool_blocks == 3


def test_blocks_of_an_adapter_match_only_requests_for_that_adapter() -> None:
    router, _ = _router()
    router.apply_events(A, _batch(_stored(PROMPT, lora="sql-adapter")))
    assert _cached(router, PROMPT, model="sql-adapter") == {A: 3, B: 0}
    assert _cached(router, PROMPT, model="base") == {A: 0, B: 0}


def test_unified_instances_take_the_first_hop_alone_while_no_decode_is_in() -> None:
    router, fleet = _router(prefill=(A,), unified=(U,))
    request = router.request(PROMPT, "m")
    assert {c.name for c in router.candidates(request, [Role.PREFILL, Role.UNIFIED])} == {A, U}
    fleet.failed(D, "gone")
    for _ in range(3):
        first = router.first_hop(request)
        assert first is not None
        assert first.instance == U
    assert router.decode(request) is None
    assert router.admit(request, first, None) is None  # no SLO configured


def test_requests_without_tokens_are_routed_by_load_alone() -> None:
    router, _ = _router()
    router.apply_events(A, _batch(_stored(PROMPT)))
    request = router.request([], "m")
    assert (request.blocks, request.prompt_tokens, request.pool_blocks) == ((), 0, 0)
    assert router.first_hop(request) is not None
