"""vLLM's KV-cache groups (hybrid models): which of a request's blocks each group moves, and
what a pool hit means per group. Pure: no torch, no vLLM imports.

With vLLM's hybrid allocator every group has its own block ids, position by position (vLLM
puts its null block, id 0, where a group holds nothing: positions a sliding window left
behind, or every position but the state's for a Mamba group):

* full attention needs every block of the prefix;
* sliding window needs the blocks the window of the next token covers;
* a state group (Mamba) needs its state block, one per request.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

NULL_BLOCK = 0
"""vLLM's placeholder block id: nothing to move at that position."""

GroupBlocks = tuple[tuple[int, ...], ...]
"""Block ids per KV-cache group, in vLLM's group order."""


class GroupKind(enum.Enum):
    FULL = enum.auto()
    SLIDING = enum.auto()
    STATE = enum.auto()


@dataclass(frozen=True, slots=True)
class Group:
    """One KV-cache group, as the connector needs it."""

    kind: GroupKind
    window: int = 0
    """Sliding window in tokens (SLIDING only)."""

    def first_needed(self, tokens: int, block_size: int) -> int:
        """The first block position the next token after ``tokens`` reads."""
        if self.kind is GroupKind.SLIDING:
            return max(0, tokens - self.window + 1) // block_size
        return 0


FULL_ONLY: tuple[Group, ...] = (Group(GroupKind.FULL),)
"""A model without hybrid groups (or vLLM's hybrid allocator off)."""


def as_groups(block_ids: Sequence[Sequence[int]]) -> GroupBlocks:
    """vLLM's per-group lists as :data:`GroupBlocks`."""
    return tuple(tuple(ids) for ids in block_ids)


def transferable(groups: Sequence[Group], block_ids: Sequence[Sequence[int]]) -> GroupBlocks:
    """Per group, the blocks of a request that hold what decode needs, in position order:
    every real (non-null) block of a full or sliding group (vLLM has already freed what a
    window left behind), the last real block of a state group."""
    moved: list[tuple[int, ...]] = []
    for group, ids in zip(groups, block_ids, strict=True):
        real = tuple(b for b in ids if b != NULL_BLOCK)
        moved.append(real[-1:] if group.kind is GroupKind.STATE else real)
    return tuple(moved)


def pair_tails(
    local: GroupBlocks, remote: GroupBlocks, counts: Sequence[int]
) -> tuple[GroupBlocks, GroupBlocks]:
    """Decode's and prefill's blocks paired per group: the first ``counts[g]`` local blocks
    (those vLLM allocated for the loaded tokens) and as many of prefill's, from its end (the
    blocks before them are decode's own prefix hit)."""
    mine: list[tuple[int, ...]] = []
    theirs: list[tuple[int, ...]] = []
    for lo, re, count in zip(local, remote, counts, strict=True):
        n = min(count, len(lo), len(re))
        mine.append(lo[:n])
        theirs.append(re[len(re) - n :])
    return tuple(mine), tuple(theirs)


def pool_blocks(
    groups: Sequence[Group],
    block_ids: Sequence[Sequence[int]],
    first: int,
    end: int,
    block_size: int,
) -> GroupBlocks:
    """The blocks at positions ``first .. end-1`` that a pool save (or load) of a prefix
    ending at block ``end`` moves, per group and position: a full group every one, a sliding
    group those its window still needs at ``end``, :data:`NULL_BLOCK` elsewhere. Raises
    ValueError for a state group (the pool does not keep states)."""
    out: list[tuple[int, ...]] = []
    for group, ids in zip(groups, block_ids, strict=True):
        if group.kind is GroupKind.STATE:
            raise ValueError("the pool does not keep Mamba states")
        needed = group.first_needed(end * block_size, block_size)
        out.append(
            tuple(ids[p] if p >= needed and p < len(ids) else NULL_BLOCK for p in range(first, end))
        )
    return tuple(out)


def usable_hit(
    groups: Sequence[Group],
    first: int,
    count: int,
    stored: Callable[[int, int], bool],
    block_size: int,
) -> int:
    """The longest pool hit of blocks ``first .. first+k-1`` (``k <= count``) every group can
    use: ``stored(group, position)`` says whether the pool holds that group's part of a
    block. Full groups need every position; sliding groups the ones their window needs at
    the hit's end; 0 with a state group."""
    if any(g.kind is GroupKind.STATE for g in groups):
        return 0
    full = [i for i, g in enumerate(groups) if g.kind is GroupKind.FULL]
    leading = 0
    while leading < count and all(stored(g, first + leading) for g in full):
        leading += 1
    for k in range(leading, 0, -1):
        end = first + k
        if all(
            stored(i, p)
            for i, g in enumerate(groups)
            if g.kind is GroupKind.SLIDING
            for p in range(max(first, g.first_needed(end * block_size, block_size)), end)
        ):
            return k
    return 0
