"""A store client workload in its own process, verifying every byte it reads.

    python -m tests.support.store_worker --master tcp://… --seconds 5 --keys 200

Every key has one deterministic size and value (derived from the key), so any worker can check
any read without coordination. Prints one JSON line: operation counts, codes seen, and the
number of corrupt reads (which must be zero).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import random
import time
from collections.abc import Sequence

import numpy as np

from kvconnect.errors import StoreError
from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.messages import Code
from kvconnect.testing.peer import pattern
from kvconnect.transfer import TransferConfig


def key_seed(key: str) -> int:
    """The seed of a key's value."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def key_size(key: str, max_size: int) -> int:
    """A key's value size: log-uniform from 1 byte to ``max_size``."""
    rng = random.Random(key_seed(key))
    return max(1, min(max_size, int(2 ** rng.uniform(0, max_size.bit_length() - 1))))


def expected(key: str, max_size: int) -> np.ndarray:
    """The value stored under ``key``."""
    return pattern(key_seed(key), key_size(key, max_size))


def run(args: argparse.Namespace) -> dict[str, object]:
    """The workload; returns the summary."""
    rng = random.Random(args.seed)
    counts: collections.Counter[str] = collections.Counter()
    corrupt = 0
    transfer = TransferConfig(transport=args.transport)
    config = StoreClientConfig(
        master=args.master, io_timeout=args.timeout, rpc_timeout=args.timeout
    )
    with StoreClient(config, transfer) as client:
        buffer = client.register(np.zeros(args.batch * args.max_size, dtype=np.uint8))
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            keys = [
                f"{args.prefix}{rng.randrange(args.keys)}"
                for _ in range(rng.randint(1, args.batch))
            ]
            keys = list(dict.fromkeys(keys))
            op = rng.choice(args.ops.split(","))
            offsets = [i * args.max_size for i in range(len(keys))]
            sizes = [key_size(k, args.max_size) for k in keys]
            try:
                if op == "put":
                    for key, off in zip(keys, offsets, strict=True):
                        value = expected(key, args.max_size)
                        buffer.view[off : off + value.size] = value.data
                    codes: Sequence[Code] = client.batch_put_from(
                        keys, buffer, offsets, sizes
                    ).codes
                elif op == "get":
                    result = client.batch_get_into(
                        keys, buffer, offsets, [args.max_size] * len(keys)
                    )
                    codes = result.codes
                    for key, off, code, size in zip(
                        keys, offsets, codes, result.sizes, strict=True
                    ):
                        if code is Code.OK and not _matches(
                            buffer.view[off : off + size], key, args
                        ):
                            corrupt += 1
                elif op == "exists":
                    codes = [Code.OK if f else Code.NOT_FOUND for f in client.batch_exists(keys)]
                else:
                    codes = client.batch_remove(keys)
            except StoreError as exc:
                counts[f"{op}:{type(exc).__name__}"] += 1
                continue
            counts[op] += 1
            for code in codes:
                counts[f"{op}:{code.name}"] += 1
    return {"counts": dict(counts), "corrupt": corrupt}


def _matches(view: memoryview, key: str, args: argparse.Namespace) -> bool:
    want = expected(key, args.max_size)
    return view.nbytes == want.size and view == want.data


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--master", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--prefix", default="key-")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-size", type=int, default=1 << 20)
    parser.add_argument("--ops", default="put,get,exists,remove")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--transport", default="auto")
    print(json.dumps(run(parser.parse_args())), flush=True)


if __name__ == "__main__":
    main()
