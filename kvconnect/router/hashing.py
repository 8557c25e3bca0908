"""The router's own block-hash chain over token ids (pure).

A prompt's full blocks of ``block_size`` tokens are hashed in a chain: each block's hash covers
its parent's hash, its token ids and ``extra`` (what besides the tokens makes a block distinct:
a LoRA adapter's name, a cache salt), so two prompts share a router hash exactly when they share
the whole prefix up to that block under the same ``extra``. The hash is 64 bits of BLAKE2b over
the parent as 8 little-endian bytes, the block's token count and token ids as little-endian
u32 and ``extra``: stable across processes, platforms and Python's hash seed.

The router never needs to reproduce an engine's own hashes: the index maps the engine hashes of
KV events to router hashes computed from the events' token ids (:mod:`.index`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvconnect.errors import ConfigError

_DIGEST = 8
_PERSON = b"kvc-router"
_MAX_TOKEN = 1 << 32

ROOT: int = int.from_bytes(hashlib.blake2b(b"root", digest_size=_DIGEST, person=_PERSON).digest())
"""The parent of a prompt's first block."""


def _tokens(tokens: Sequence[int]) -> bytes:
    array = np.asarray(tokens, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() >= _MAX_TOKEN):
        raise ConfigError(f"token ids must be in [0, 2**32), got {array.min()}..{array.max()}")
    return array.astype("<u4").tobytes()


def _hash(parent: int, count: int, packed: bytes, extra: bytes) -> int:
    digest = hashlib.blake2b(digest_size=_DIGEST, person=_PERSON)
    digest.update(parent.to_bytes(8, "little"))
    digest.update(count.to_bytes(4, "little"))
    digest.update(packed)
    digest.update(extra)
    return int.from_bytes(digest.digest(), "little")


def block_hash(parent: int, tokens: Sequence[int], extra: bytes = b"") -> int:
    """The hash of the block of ``tokens`` whose parent block hashes to ``parent`` (``ROOT`` for
    a prompt's first block). Token ids must be in [0, 2**32) (``ConfigError`` otherwise)."""
    return _hash(parent, len(tokens), _tokens(tokens), extra)


def chain(
    tokens: Sequence[int], block_size: int, extra: bytes = b"", *, parent: int = ROOT
) -> tuple[int, ...]:
    """The hashes of the full blocks of ``tokens``, first block first; a partial last block has
    none (engines cache full blocks only). Equal to folding :func:`block_hash` from ``parent``
    (a prompt's: ``ROOT``; the index continues an engine's chain from a known block)."""
    if block_size < 1:
        raise ConfigError(f"block_size must be at least 1, got {block_size}")
    packed = _tokens(tokens)
    width = 4 * block_size
    hashes: list[int] = []
    for start in range(0, len(tokens) // block_size * width, width):
        parent = _hash(parent, block_size, packed[start : start + width], extra)
        hashes.append(parent)
    return tuple(hashes)
