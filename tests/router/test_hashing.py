from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconnect.errors import ConfigError
from kvconnect.router.hashing import ROOT, block_hash, chain

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=40)


@given(tokens, st.integers(1, 8), st.binary(max_size=8))
def test_the_chain_folds_block_hash_from_the_root_over_full_blocks_only(
    ids: list[int], size: int, extra: bytes
) -> None:
    expected = []
    parent = ROOT
    for start in range(0, len(ids) - size + 1, size):
        parent = block_hash(parent, ids[start : start + size], extra)
        expected.append(parent)
    assert chain(ids, size, extra) == tuple(expected)
    assert len(expected) == len(ids) // size
    if expected:  # a chain continues from any of its blocks
        assert chain(ids[size:], size, extra, parent=expected[0]) == tuple(expected[1:])


@given(tokens, tokens, st.integers(1, 4))
def test_two_prompts_share_exactly_their_common_full_blocks(
    a: list[int], b: list[int], size: int
) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ca, cb = chain(a, size), chain(b, size)
    shared = 0
    while shared < min(len(ca), len(cb)) and ca[shared] == cb[shared]:
        shared += 1
    assert shared == min(common // size, len(ca), len(cb))


def test_extra_keeps_adapters_apart_and_blocks_are_not_ambiguous() -> None:
    ids = list(range(8))
    assert chain(ids, 4, b"lora-a") != chain(ids, 4, b"lora-b")
    assert chain(ids, 4, b"lora-a")[0] != chain(ids, 4)[0]
    # a token moved from the block into extra does not give the same hash
    assert block_hash(ROOT, [1, 2]) != block_hash(ROOT, [1], (2).to_bytes(4, "little"))


def test_hashes_are_stable_across_processes() -> None:
    code = "from kvconnect.router.hashing import chain; print(chain(list(range(10)), 4, b'x'))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert runs == {f"{chain(list(range(10)), 4, b'x')}\n"}


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_token_ids_outside_u32_are_refused(bad: list[int]) -> None:
    with pytest.raises(ConfigError):
        chain(bad, 1)
    with pytest.raises(ConfigError):
        block_hash(ROOT, bad)


def test_a_block_size_below_one_is_refused() -> None:
    with pytest.raises(ConfigError):
        chain([1, 2], 0)
