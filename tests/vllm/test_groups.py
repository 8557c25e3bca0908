"""KV-cache groups of hybrid models (kvconnect/vllm/groups.py): pure, every environment. The
block lists are the shapes vLLM 0.33's hybrid allocator hands out (tests/vllm/test_hybrid.py
drives the real one)."""

from __future__ import annotations

import pytest

from kvconnect.vllm.groups import (
    NULL_BLOCK,
    Group,
    GroupKind,
    pair_tails,
    pool_blocks,
    transferable,
    usable_hit,
)

FULL = Group(GroupKind.FULL)
SWA = Group(GroupKind.SLIDING, window=24)  # blocks of 16: the window spans 2 or 3 blocks
STATE = Group(GroupKind.STATE)


def test_a_window_needs_the_blocks_its_next_token_reads() -> None:
    assert SWA.first_needed(80, 16) == 3  # tokens 57..79: blocks 3 and 4
    assert SWA.first_needed(79, 16) == 3
    assert SWA.first_needed(72, 16) == 3  # tokens 49..71
    assert SWA.first_needed(64, 16) == 2
    assert SWA.first_needed(20, 16) == 0
    assert FULL.first_needed(80, 16) == 0


def test_transfers_move_real_blocks_and_a_states_last_one() -> None:
    # what prefill holds when vLLM finishes an 80-token prompt (nulls where SWA freed blocks)
    held = transferable((FULL, SWA, STATE), ([1, 2, 3, 4, 5], [0, 0, 0, 9, 10], [0, 0, 0, 0, 7]))
    assert held == ((1, 2, 3, 4, 5), (9, 10), (7,))


def test_decode_pairs_its_new_blocks_with_the_tail_of_prefills() -> None:
    local, remote = pair_tails(((4, 5, 6), (8, 9)), ((1, 2, 3, 4, 5), (9, 10)), (3, 2))
    assert local == ((4, 5, 6), (8, 9))
    assert remote == ((3, 4, 5), (9, 10))  # decode had the first two full blocks already


def test_the_pool_moves_what_each_window_needs_at_the_prefix_end() -> None:
    blocks = pool_blocks((FULL, SWA), ([1, 2, 3, 4, 5], [0, 0, 0, 9, 10]), 1, 5, 16)
    assert blocks == ((2, 3, 4, 5), (NULL_BLOCK, NULL_BLOCK, 9, 10))
    with pytest.raises(ValueError, match="Mamba"):
        pool_blocks((FULL, STATE), ([1], [2]), 0, 1, 16)


def test_a_hit_is_the_longest_prefix_every_group_can_use() -> None:
    # The pool holds an 80-token prompt: full attention every block, the window its last two.
    saved = {(0, p) for p in range(5)} | {(1, 3), (1, 4)}

    def stored(group: int, position: int) -> bool:
        return (group, position) in saved

    assert usable_hit((FULL, SWA), 0, 5, stored, 16) == 5
    assert usable_hit((FULL, SWA), 0, 3, stored, 16) == 0, "no window blocks before block 3"
    assert usable_hit((FULL,), 0, 3, stored, 16) == 3
    assert usable_hit((FULL, SWA), 4, 1, stored, 16) == 1, "block 3 is a local hit"
    saved.discard((1, 3))
    assert usable_hit((FULL, SWA), 0, 5, stored, 16) == 0
    assert usable_hit((FULL, STATE), 0, 5, stored, 16) == 0, "the pool keeps no states"
