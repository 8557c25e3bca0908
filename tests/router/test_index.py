"""PrefixIndex against a reference model that knows which prefixes each source holds."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvconnect.errors import ConfigError
from kvconnect.router.hashing import chain
from kvconnect.router.index import POOL, IndexStats, PrefixIndex

SIZE = 3
BASE = list(range(1, 13))
PROMPTS = (BASE, BASE[:6] + list(range(50, 56)), list(range(90, 102)))
BLOCKS = len(BASE) // SIZE
# "a" hashes as the fleet (and the pool) does; "b" has a seed of its own: the index must not
# rely on local hashes agreeing across instances.
SEEDS = {"a": b"fleet", "b": b"other", POOL: b"fleet"}


def engine_hash(seed: bytes, prefix: tuple[int, ...]) -> bytes:
    return hashlib.sha256(seed + repr(prefix).encode()).digest()


def prefix(prompt: int, blocks: int) -> tuple[int, ...]:
    return tuple(PROMPTS[prompt][: blocks * SIZE])


class Model:
    """owner -> prefix -> media; the fallbacks the index uses to place a parent."""

    def __init__(self) -> None:
        self.held: dict[str, dict[tuple[int, ...], set[str | None]]] = {}
        self.orphans = 0

    def holds(self, owner: str, key: tuple[int, ...]) -> bool:
        return key in self.held.get(owner, {})

    def parent_known(self, owner: str, source: str, key: tuple[int, ...]) -> bool:
        # The index finds a parent by engine hash in the owner, then the source or the pool;
        # only sources hashing as the fleet share keys with the pool.
        other = source if owner == POOL else POOL
        return self.holds(owner, key) or (
            SEEDS[other] == SEEDS[owner if owner != POOL else source] and self.holds(other, key)
        )

    def leading(self, owner: str, prompt: int) -> int:
        count = 0
        while count < BLOCKS and self.holds(owner, prefix(prompt, count + 1)):
            count += 1
        return count


class IndexMachine(RuleBasedStateMachine):
    capacity = 10_000

    @initialize()
    def build(self) -> None:
        self.index = PrefixIndex(self.capacity)
        self.model = Model()

    @rule(
        source=st.sampled_from(["a", "b"]),
        prompt=st.integers(0, len(PROMPTS) - 1),
        start=st.integers(0, BLOCKS - 1),
        length=st.integers(1, BLOCKS),
        medium=st.sampled_from([None, "GPU", "CPU"]),
        pool=st.booleans(),
        short=st.booleans(),
    )
    def stored(
        self,
        source: str,
        prompt: int,
        start: int,
        length: int,
        medium: str | None,
        pool: bool,
        short: bool,
    ) -> None:
        if pool and source == "b":
            return  # pool hashes are the fleet's: only "a" announces pool blocks
        owner = POOL if pool else source
        end = min(start + length, BLOCKS)
        seed = SEEDS[source]
        hashes = [engine_hash(seed, prefix(prompt, i + 1)) for i in range(start, end)]
        parent = engine_hash(seed, prefix(prompt, start)) if start else None
        tokens = PROMPTS[prompt][start * SIZE : end * SIZE]
        if short:
            tokens = tokens[:-1]  # the last block lacks a token: it cannot be placed
        self.index.stored(source, hashes, parent, tokens, SIZE, b"", pool, medium=medium)
        if start and not self.model.parent_known(owner, source, prefix(prompt, start)):
            self.model.orphans += end - start
            return
        placed = end - start - (1 if short else 0)
        for i in range(start, start + placed):
            media = self.model.held.setdefault(owner, {}).setdefault(prefix(prompt, i + 1), set())
            media.add(None if pool else medium)
        self.model.orphans += end - start - placed

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), block=st.integers(1, BLOCKS))
    def store_announced(self, prompt: int, block: int) -> None:
        key = prefix(prompt, block)
        self.index.stored_hashes([engine_hash(b"fleet", key)])
        if self.model.holds(POOL, key) or self.model.holds("a", key):
            self.model.held.setdefault(POOL, {}).setdefault(key, set()).add(None)
        else:
            self.model.orphans += 1

    @rule(
        source=st.sampled_from(["a", "b", POOL]),
        prompt=st.integers(0, len(PROMPTS) - 1),
        block=st.integers(1, BLOCKS),
        medium=st.sampled_from([None, "GPU", "CPU"]),
        as_int=st.booleans(),
    )
    def removed(
        self, source: str, prompt: int, block: int, medium: str | None, as_int: bool
    ) -> None:
        key = prefix(prompt, block)
        digest = engine_hash(SEEDS[source], key)
        # vLLM's integer form of a hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) is the same block
        hashed: bytes | int = int.from_bytes(digest, "big") & (2**64 - 1) if as_int else digest
        pool = source == POOL
        self.index.removed("store" if pool else source, [hashed], pool, medium=medium)
        media = self.model.held.get(source, {}).get(key)
        if media is not None:
            media.discard(None if pool else medium)
            if not media:
                del self.model.held[source][key]

    @rule(source=st.sampled_from(["a", "b", POOL]), clear=st.booleans())
    def gone(self, source: str, clear: bool) -> None:
        if clear:
            self.index.cleared(source)
        else:
            self.index.drop(source)
        self.model.held.pop(source, None)

    @invariant()
    def agrees(self) -> None:
        for owner in ("a", "b", POOL):
            for prompt in range(len(PROMPTS)):
                blocks = chain(PROMPTS[prompt], SIZE)
                assert self.index.leading(owner, blocks) == self.model.leading(owner, prompt)
        assert self.index.pool_leading(chain(PROMPTS[0], SIZE)) == self.model.leading(POOL, 0)
        entries = sum(len(held) for held in self.model.held.values())
        assert self.index.stats() == IndexStats(entries, self.model.orphans, 0)


class BoundedIndexMachine(IndexMachine):
    """With a small capacity the index may forget, but never claims a block nobody holds."""

    capacity = 5

    @invariant()
    def agrees(self) -> None:
        assert self.index.stats().entries <= self.capacity
        for owner in ("a", "b", POOL):
            for prompt in range(len(PROMPTS)):
                blocks = chain(PROMPTS[prompt], SIZE)
                assert self.index.leading(owner, blocks) <= self.model.leading(owner, prompt)


TestIndexAgainstTheModel = IndexMachine.TestCase
TestIndexAgainstTheModel.settings = settings(max_examples=150, stateful_step_count=30)
TestBoundedIndex = BoundedIndexMachine.TestCase
TestBoundedIndex.settings = settings(max_examples=100, stateful_step_count=30)


def announce(index: PrefixIndex, source: str, tokens: list[int], pool: bool = False) -> None:
    hashes = [
        engine_hash(b"fleet", tuple(tokens[: (i + 1) * SIZE])) for i in range(len(tokens) // SIZE)
    ]
    index.stored(source, hashes, None, tokens, SIZE, b"", pool)


def test_the_least_recently_used_block_is_dropped_and_a_lookup_counts_as_use() -> None:
    index = PrefixIndex(capacity=4)
    hot, cold = list(range(1, 7)), list(range(20, 26))
    announce(index, "a", hot)  # 2 entries
    announce(index, "b", cold)  # 4 entries
    assert index.leading("a", chain(hot, SIZE)) == 2  # hot is now the most recently used
    announce(index, "b", list(range(40, 46)))  # 6 entries: the two least recently used go
    assert index.leading("a", chain(hot, SIZE)) == 2
    assert index.leading("b", chain(cold, SIZE)) == 0
    assert index.stats() == IndexStats(entries=4, orphans=0, dropped=2)


def test_a_block_whose_parent_was_dropped_is_an_orphan() -> None:
    index = PrefixIndex(capacity=1)
    tokens = list(range(1, 7))
    announce(index, "a", tokens[:3])
    announce(index, "b", list(range(30, 33)))  # drops a's block
    child = engine_hash(b"fleet", tuple(tokens))
    index.stored(
        "a", [child], engine_hash(b"fleet", tuple(tokens[:3])), tokens[3:], SIZE, b"", False
    )
    assert index.stats() == IndexStats(entries=1, orphans=1, dropped=1)
    assert index.leading("a", chain(tokens, SIZE)) == 0


def test_extra_keeps_adapters_apart() -> None:
    index = PrefixIndex(capacity=100)
    tokens = list(range(1, 7))
    index.stored("a", [b"x1", b"x2"], None, tokens, SIZE, b"lora-1", False)
    assert index.leading("a", chain(tokens, SIZE, b"lora-1")) == 2
    assert index.leading("a", chain(tokens, SIZE)) == 0


def test_an_engine_hash_announced_again_with_other_tokens_takes_the_latest() -> None:
    index = PrefixIndex(capacity=100)
    first, second = list(range(1, 4)), list(range(7, 10))
    index.stored("a", [b"same"], None, first, SIZE, b"", False)
    index.stored("a", [b"same"], None, second, SIZE, b"", False)
    assert index.leading("a", chain(first, SIZE)) == 0
    assert index.leading("a", chain(second, SIZE)) == 1
    assert index.stats().entries == 1


def test_a_capacity_below_one_is_refused() -> None:
    with pytest.raises(ConfigError):
        PrefixIndex(0)


def test_one_engine_hash_per_block_and_source_is_kept_the_latest() -> None:
    """An engine that hashes more than the router (multimodal inputs) may name one router block
    by two engine hashes; the index keeps the latest and ignores removals of the other."""
    index = PrefixIndex(capacity=100)
    tokens = list(range(1, 4))
    index.stored("a", [b"first"], None, tokens, SIZE, b"", False)
    index.stored("a", [b"second"], None, tokens, SIZE, b"", False)
    assert index.stats().entries == 1
    index.removed("a", [b"first"], False)
    assert index.leading("a", chain(tokens, SIZE)) == 1
    index.removed("a", [b"second"], False)
    assert index.leading("a", chain(tokens, SIZE)) == 0
    assert index.stats().entries == 0


def test_a_block_stays_held_while_one_tier_of_the_source_holds_it() -> None:
    index = PrefixIndex(capacity=100)
    tokens = list(range(1, 4))
    for medium in ("GPU", "CPU"):
        index.stored("a", [b"h"], None, tokens, SIZE, b"", False, medium=medium)
    index.removed("a", [b"h"], False, medium="GPU")
    assert index.leading("a", chain(tokens, SIZE)) == 1
    index.removed("a", [b"h"], False, medium="CPU")
    assert index.leading("a", chain(tokens, SIZE)) == 0
