"""Decode reading from prefill at another TP size, block size or KV layout, with real worker
sides (a transfer engine per rank, over TCP) and vLLM-shaped KV tensors (logical ``[blocks,
heads, tokens, K|V]``, strides permuted for the layout): every decode rank ends with exactly
its heads of the prompt's tokens, byte for byte, and prefill frees the blocks only when every
decode rank confirmed (no vLLM needed)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import ExitStack, closing
from dataclasses import dataclass
from typing import Any

import pytest

from kvconnect.vllm import messages as msg
from kvconnect.vllm.config import VllmConnectorConfig
from kvconnect.vllm.groups import pair_tails
from kvconnect.vllm.params import RemotePrefill
from kvconnect.vllm.pd import PrefillService
from kvconnect.vllm.plan import RecvJob, StepPlan
from kvconnect.vllm.sidechannel import SideChannelClient
from kvconnect.vllm.tpmap import head_range
from kvconnect.vllm.worker import ConnectorWorker, EngineFormat
from tests.support.waiting import wait_for

torch = pytest.importorskip("torch")

TOKEN = os.environ["KVCONNECT_TOKEN"]  # set by tests/conftest.py
CONFIG = VllmConnectorConfig.from_mapping(
    {"transport": "tcp", "read_timeout": 5.0, "rpc_timeout": 1.0}
)
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
CONTENT = 8  # K|V of one token of one head, float32
BLOCKS = 12
PROMPT = 70  # tokens prefill computed
HAD = 32  # tokens decode had already (its own prefix cache)


@dataclass(frozen=True)
class Engine:
    """One side: TP size, block size, KV layout (vLLM's name), model KV heads, attention
    backend (CPU_ATTN keeps each head's K of all tokens, then their V)."""

    tp: int
    block_size: int
    layout: str = "LBHNC"  # heads outer (ex-HND); LBNHC: tokens outer (ex-NHD)
    heads: int = 4  # 1: MLA's latent
    backend: str = "FLASH_ATTN"

    def format(self, rank: int) -> EngineFormat:
        return EngineFormat(
            model="m",
            dtype="auto/float32",
            block_size=self.block_size,
            tp_rank=rank,
            tp_size=self.tp,
            engine="vllm 0.33.0",
            attention_backend=self.backend,
            kv_layout=self.layout,
            total_kv_heads=self.heads,
        )

    def caches(self, rank: int) -> dict[str, Any]:
        """Zeroed layers of this rank, in vLLM's logical shape with the layout's strides."""
        count = head_range(rank, self.tp, self.heads)[1]
        if self.layout == "LBHNC":
            shape = (BLOCKS, count, self.block_size, CONTENT)
            return {name: torch.zeros(shape) for name in LAYERS}
        shape = (BLOCKS, self.block_size, count, CONTENT)
        return {name: torch.zeros(shape).permute(0, 2, 1, 3) for name in LAYERS}


def prompt_kv(heads: int) -> dict[str, Any]:
    """Every layer's K|V of the prompt: ``[token, head, content]``, seeded."""
    generator = torch.Generator().manual_seed(7)
    return {name: torch.randn(PROMPT, heads, CONTENT, generator=generator) for name in LAYERS}


def write(caches: dict[str, Any], kv: dict[str, Any], blocks: list[int], first: int, at: int,
          heads: tuple[int, int], engine: Engine, tokens: int) -> None:  # fmt: skip
    """Put tokens ``at..at+tokens`` of ``kv`` (heads ``heads``) into ``blocks``, which hold the
    prompt from token ``first``, as ``engine``'s attention backend does."""
    head, count = heads
    size, half = engine.block_size, CONTENT // 2
    for name, cache in caches.items():
        for position in range(at, at + tokens):
            block, slot = divmod(position - first, size)
            rows = kv[name][position, head : head + count]
            if engine.backend == "CPU_ATTN":  # each head: K of all tokens, then their V
                halves = cache.view(BLOCKS, count, 2 * size, half)
                halves[blocks[block], :, slot] = rows[:, :half]
                halves[blocks[block], :, size + slot] = rows[:, half:]
            else:
                cache[blocks[block], :, slot] = rows


@dataclass
class Ranks:
    workers: list[ConnectorWorker]
    caches: list[dict[str, Any]]


def start_ranks(stack: ExitStack, engine: Engine) -> Ranks:
    ranks = Ranks([], [])
    for rank in range(engine.tp):
        worker = stack.enter_context(closing(ConnectorWorker(CONFIG, engine.format(rank), BLOCKS)))
        caches = engine.caches(rank)
        worker.register(caches)
        ranks.workers.append(worker)
        ranks.caches.append(caches)
    return ranks


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def read(stack: ExitStack, p: Engine, d: Engine) -> tuple[Ranks, dict[str, Any], list[int]]:
    """Prefill ``p`` holds the prompt; every decode rank of ``d`` reads it (from token
    ``HAD``); returns decode's ranks, the prompt's KV and decode's blocks. Asserts prefill
    frees its blocks at the last decode rank's confirmation, not before."""
    kv = prompt_kv(p.heads)
    prefill = start_ranks(stack, p)
    remote_blocks = [9, 2, 5, 0, 7, 11, 3, 8, 1, 4, 6, 10][: -(-PROMPT // p.block_size)]
    for rank, caches in enumerate(prefill.caches):
        heads = head_range(rank, p.tp, p.heads)
        write(caches, kv, remote_blocks, 0, 0, heads, p, PROMPT)
    service = PrefillService("prefill", "127.0.0.1", 0, lease=30, token=TOKEN)
    stack.callback(service.close)
    service.set_layouts({r: w.layout for r, w in enumerate(prefill.workers) if w.layout})
    service.start()
    service.hold("p1")
    decode = start_ranks(stack, d)
    local_blocks = [6, 1, 10, 3][: -(-(PROMPT - HAD) // d.block_size)]
    job = recv_job("d1", "p1", service.port, p.tp, local_blocks, remote_blocks)
    for rank, worker in enumerate(decode.workers):
        assert service.take_released() == [], f"freed before decode rank {rank} confirmed"
        worker.start(StepPlan(recv=(job,)))
        assert outcome(worker) == ({"d1"}, set())
    wait_for(lambda: service.held() == 0, "prefill kept the blocks")
    assert service.take_released() == ["p1"]
    return decode, kv, local_blocks


def recv_job(
    rid: str, remote_id: str, port: int, tp: int, local: list[int], remote: list[int]
) -> RecvJob:
    """The job decode's scheduler side plans for a prompt prefill holds in ``remote`` (from
    its first token) and decode gets ``local`` blocks for (from token ``HAD``): the blocks
    paired from prefill's end, and every block prefill holds in the params."""
    target = RemotePrefill("prefill", remote_id, "127.0.0.1", port, (tuple(remote),), tp, PROMPT)
    mine, theirs = pair_tails((tuple(local),), (tuple(remote),), [len(local)])
    return RecvJob(rid, target, mine, theirs, first_token=HAD)


def outcome(worker: ConnectorWorker) -> tuple[set[str], set[str]]:
    """The first step's ``(finished_recving, failed_recving)`` that is not empty."""
    got: list[tuple[set[str], set[str]]] = []

    def collected() -> bool:
        _sending, recving, failed = worker.results(set())
        if recving:
            got.append((recving, failed))
        return bool(recving)

    wait_for(collected, "decode never finished its read")
    return got[0]


def expected(d: Engine, rank: int, kv: dict[str, Any], blocks: list[int]) -> dict[str, Any]:
    caches = d.caches(rank)
    tokens = min(len(blocks) * d.block_size, PROMPT - HAD)
    write(caches, kv, blocks, HAD, HAD, head_range(rank, d.tp, d.heads), d, tokens)
    return caches


COMBINATIONS = {
    "P2-D1": (Engine(2, 16), Engine(1, 16)),
    "P1-D2": (Engine(1, 16), Engine(2, 16)),
    "P2-D2-HND-NHD": (Engine(2, 16), Engine(2, 16, "LBNHC")),
    "P1-D1-NHD-HND": (Engine(1, 16, "LBNHC"), Engine(1, 16)),
    "P16-D32": (Engine(1, 16), Engine(1, 32)),
    "P32-D16": (Engine(1, 32), Engine(1, 16)),
    "P2-D1-P16-D32-NHD": (Engine(2, 16, "LBNHC"), Engine(1, 32)),
    "P1-D2-P32-D16-NHD": (Engine(1, 32), Engine(2, 16, "LBNHC")),
    "GQA-P4-D1": (Engine(4, 16, heads=2), Engine(1, 16, heads=2)),
    "GQA-P1-D4": (Engine(1, 16, heads=2), Engine(4, 16, heads=2)),
    "MLA-P2-D1": (Engine(2, 16, "LBNHC", heads=1), Engine(1, 16, "LBNHC", heads=1)),
    "MLA-P1-D2": (Engine(1, 16, "LBNHC", heads=1), Engine(2, 32, "LBNHC", heads=1)),
    "CPU-P2-D1": (Engine(2, 32, backend="CPU_ATTN"), Engine(1, 32, backend="CPU_ATTN")),
    "CPU-P1-D2": (Engine(1, 32, backend="CPU_ATTN"), Engine(2, 32, backend="CPU_ATTN")),
}


@pytest.mark.parametrize("combination", sorted(COMBINATIONS))
def test_every_decode_rank_reads_exactly_its_heads_and_tokens(
    stack: ExitStack, combination: str
) -> None:
    p, d = COMBINATIONS[combination]
    decode, kv, blocks = read(stack, p, d)
    for rank, caches in enumerate(decode.caches):
        for name, want in expected(d, rank, kv, blocks).items():
            assert torch.equal(caches[name], want), f"rank {rank} {name}"


def test_equal_engines_read_whole_blocks(stack: ExitStack) -> None:
    engine = Engine(1, 16)
    decode, _, _ = read(stack, engine, engine)
    stats = decode.workers[0].stats.take()
    assert stats["pd_bytes"] == 3 * 16 * 4 * CONTENT * 4 * len(LAYERS), "whole blocks"


def test_a_latent_is_read_once_from_one_prefill_rank(stack: ExitStack) -> None:
    p, d = COMBINATIONS["MLA-P2-D1"]
    decode, _, _ = read(stack, p, d)
    stats = decode.workers[0].stats.take()
    tokens = 3 * 16  # decode's three blocks, filled from prefill's (its last one in part)
    assert stats["pd_bytes"] == tokens * CONTENT * 4 * len(LAYERS)


REFUSED = {
    "other KV heads": (Engine(2, 16, heads=4), Engine(1, 16, heads=2), "KV heads: 4 at the peer"),
    # vLLM's CPU attention orders a block's tokens by its block size: never mapped.
    "CPU block sizes": (
        Engine(2, 32, backend="CPU_ATTN"),
        Engine(1, 64, backend="CPU_ATTN"),
        "lays a block's tokens out by its block size",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_unmappable_prefill_is_refused_once(
    stack: ExitStack, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    p, d, why = REFUSED[case]
    prefill = start_ranks(stack, p)
    service = PrefillService("prefill", "127.0.0.1", 0, lease=30, token=TOKEN)
    stack.callback(service.close)
    service.set_layouts({r: w.layout for r, w in enumerate(prefill.workers) if w.layout})
    service.start()
    decode = start_ranks(stack, d)
    with caplog.at_level(logging.ERROR, logger="kvconnect"):
        for rid in ("d1", "d2"):
            service.hold(rid)
            job = recv_job(rid, rid, service.port, p.tp, [1, 2], [3, 4, 5])
            decode.workers[0].start(StepPlan(recv=(job,)))
            assert outcome(decode.workers[0]) == ({rid}, {rid})
    refusals = [r for r in caplog.records if "incompatible KV format" in r.getMessage()]
    assert len(refusals) == 1
    assert why in refusals[0].getMessage()
    assert not any(c.any() for c in decode.caches[0].values()), "nothing was read"
    assert decode.workers[0].stats.take()["pd_incompatible"] == 2


@pytest.mark.parametrize(("reader", "readers"), [(2, 2), (-1, 2), (0, 0), (0, 1025)])
def test_a_confirmation_naming_an_impossible_reader_is_refused(
    stack: ExitStack, reader: int, readers: int
) -> None:
    service = PrefillService("prefill", "127.0.0.1", 0, lease=30, token=TOKEN)
    stack.callback(service.close)
    service.start()
    service.hold("p1")
    client = SideChannelClient(1.0, token=TOKEN)
    stack.callback(client.close)
    reply = client.call(f"tcp://127.0.0.1:{service.port}", msg.Confirm("p1", reader, readers))
    assert isinstance(reply, msg.Ack)
    assert not reply.ok
    assert service.held() == 1, "the lease holds on"
