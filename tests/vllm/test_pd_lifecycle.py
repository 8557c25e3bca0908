"""Prefill and decode with vLLM's real Scheduler on both sides and real worker sides (transfer
engines over TCP, KV tensors in memory; no model): decode's messages may reach prefill at any
point between prefill's steps, and prefill's blocks are freed whatever the interleaving."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvconnect.vllm import messages as msg
from kvconnect.vllm.sidechannel import SideChannelClient
from kvconnect.vllm.worker import ConnectorWorker
from tests.vllm.harness import (
    assert_empty,
    handshake,
    kv_worker,
    make_request,
    make_scheduler,
    plan_of,
    step,
)

BLOCKS = 64
PROMPT = list(range(10, 50))  # 40 tokens: 2 full blocks and a partial one

Engine = tuple[Scheduler, ConnectorWorker, dict[str, Any]]


def _engine(model: Path, role: str, seed: int | None, engine_id: str | None) -> Iterator[Engine]:
    scheduler = make_scheduler(model, role, {"lease": 30.0}, engine_id=engine_id, num_blocks=BLOCKS)
    try:
        with kv_worker(BLOCKS, seed) as (worker, caches):
            handshake(scheduler, worker)
            yield scheduler, worker, caches
    finally:
        scheduler.shutdown()


@pytest.fixture
def prefill(tiny_config: Path) -> Iterator[Engine]:
    yield from _engine(tiny_config, "kv_producer", 1, "prefill-engine")


@pytest.fixture
def decode(tiny_config: Path) -> Iterator[Engine]:
    yield from _engine(tiny_config, "kv_consumer", None, None)


def _step_until(engine: Engine, done: Callable[[], bool], timeout: float = 10.0) -> None:
    """Step ``engine`` with its worker until ``done()`` (the worker's transfers run on threads
    of their own: their results show up in a later step)."""
    scheduler, worker, _ = engine
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the engine never got there"
        step(scheduler, worker=worker)
        time.sleep(0.01)


def _finish_prefill(engine: Engine) -> dict[str, Any]:
    """One step that computes a prefill-only request; its kv_transfer_params for decode."""
    scheduler, worker, _ = engine
    scheduler.add_request(
        make_request("p1", PROMPT, max_tokens=1, params={"do_remote_decode": True})
    )
    _, outputs = step(scheduler, worker=worker)
    assert outputs["p1"].finish_reason is not None
    assert "p1" in scheduler.requests, "prefill keeps the blocks for decode"
    params: dict[str, Any] = outputs["p1"].kv_transfer_params
    return params


def _next_step_frees_prefill(engine: Engine) -> None:
    """Prefill's first step after decode let go: the plan holds and releases the request at
    once, and that very step hands its blocks back to vLLM."""
    scheduler, worker, _ = engine
    output, _ = step(scheduler, worker=worker)
    plan = plan_of(output)
    assert (plan.held, plan.released) == (("p1",), ("p1",)), "the interleaving under test"
    assert_empty(scheduler)


def test_a_read_confirmed_before_prefills_next_step_frees_its_blocks(
    prefill: Engine, decode: Engine
) -> None:
    p_caches, (d, dw, d_caches) = prefill[2], decode
    params = _finish_prefill(prefill)
    d.add_request(make_request("d1", PROMPT, max_tokens=3, params=params))
    output, _ = step(d, worker=dw)
    (job,) = plan_of(output).recv
    # Decode reads and confirms while prefill does not step.
    _step_until(decode, lambda: d.requests["d1"].status != RequestStatus.WAITING_FOR_REMOTE_KVS)
    for name, cache in d_caches.items():
        for local, remote in zip(job.local_blocks, job.remote_blocks, strict=True):
            assert torch.equal(cache[:, local], p_caches[name][:, remote])
    _next_step_frees_prefill(prefill)
    _step_until(decode, lambda: not d.requests)
    assert_empty(d)


def test_a_give_up_before_prefills_next_step_frees_its_blocks(prefill: Engine) -> None:
    params = _finish_prefill(prefill)
    client = SideChannelClient(timeout=2.0)
    try:  # what decode sends when it will not read (aborted, or it had the prefix)
        endpoint = f"tcp://{params['remote_host']}:{params['remote_port']}"
        assert client.call(endpoint, msg.GiveUp(["p1"])) == msg.Ack(True)
    finally:
        client.close()
    _next_step_frees_prefill(prefill)
