"""Prefill and decode with vLLM's real Scheduler on both sides and real worker sides (transfer
engines over TCP, KV tensors in memory; no model): decode's messages may reach prefill at any
point between prefill's steps, and prefill's blocks are freed whatever the interleaving."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
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
    FORMAT,
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
        for local, remote in zip(job.local_blocks[0], job.remote_blocks[0], strict=True):
            assert torch.equal(cache[:, local], p_caches[name][:, remote])
    _next_step_frees_prefill(prefill)
    _step_until(decode, lambda: not d.requests)
    assert_empty(d)


def test_a_give_up_before_prefills_next_step_frees_its_blocks(prefill: Engine) -> None:
    params = _finish_prefill(prefill)
    client = SideChannelClient(timeout=2.0, token=os.environ["KVCONNECT_TOKEN"])
    try:  # what decode sends when it will not read (aborted, or it had the prefix)
        endpoint = f"tcp://{params['remote_host']}:{params['remote_port']}"
        assert client.call(endpoint, msg.GiveUp(["p1"])) == msg.Ack(True)
    finally:
        client.close()
    _next_step_frees_prefill(prefill)


@pytest.mark.parametrize(
    ("layout", "change", "field"),
    [
        ("HND", {}, "layer model.layers.0.attn block_shape"),
        ("HND-strides", {}, "layer model.layers.0.attn block_strides"),
        ("NHD", {"engine": "vllm 0.32.0"}, "engine"),
        ("NHD", {"revision": "0123abcd"}, "revision"),
        ("NHD", {"attention_backend": "FLASHINFER"}, "attention_backend"),
        ("NHD", {"kv_layout": "HND"}, "kv_layout"),
        ("NHD", {"dtype": "fp8/float32"}, "dtype"),
        ("NHD", {"tp_size": 2}, "tp_size"),
    ],
)
def test_an_incompatible_prefill_is_refused_once_and_decode_recomputes(
    tiny_config: Path,
    caplog: pytest.LogCaptureFixture,
    layout: str,
    change: dict[str, object],
    field: str,
) -> None:
    """Prefill's blocks have the same size as decode's but other bytes (or come from another
    engine version, model revision, attention backend or layout): decode reads none of them,
    says why once, counts the refusals, and vLLM recomputes the prompts."""
    p = make_scheduler(tiny_config, "kv_producer", {"lease": 30.0}, engine_id="prefill-engine")
    d = make_scheduler(tiny_config, "kv_consumer", {"lease": 30.0}, policy="recompute")
    prefill_format = replace(FORMAT, **change)
    try:
        with (
            kv_worker(seed=1, layout=layout, fmt=prefill_format) as (pw, _),
            kv_worker() as (dw, d_caches),
        ):
            handshake(p, pw)
            handshake(d, dw)
            prompts = {"p1": PROMPT, "p2": [t + 100 for t in PROMPT]}  # no common prefix
            for rid, prompt in prompts.items():
                p.add_request(
                    make_request(rid, prompt, max_tokens=1, params={"do_remote_decode": True})
                )
            _, outputs = step(p, worker=pw)
            for rid, prompt in prompts.items():
                params = outputs[rid].kv_transfer_params
                d.add_request(make_request(f"d-{rid}", prompt, max_tokens=1, params=params))
            computed = {"d-p1": 0, "d-p2": 0}
            deadline = time.monotonic() + 10
            with caplog.at_level(logging.ERROR, logger="kvconnect"):
                while d.requests:
                    assert time.monotonic() < deadline, "decode never finished"
                    output, _ = step(d, worker=dw)
                    for rid, count in output.num_scheduled_tokens.items():
                        computed[rid] += count
                    time.sleep(0.01)
            assert computed == {"d-p1": len(PROMPT), "d-p2": len(PROMPT)}, "recomputed in full"
            assert not any(cache.any() for cache in d_caches.values()), "nothing was read"
            (record,) = [r for r in caplog.records if r.name.startswith("kvconnect")]
            assert record.levelno == logging.ERROR
            assert f"{field}: " in record.getMessage(), record.getMessage()
            stats = dw.stats.take()
            assert (stats["pd_reads"], stats["pd_failed"], stats["pd_incompatible"]) == (2, 2, 2)
            _step_until((p, pw, {}), lambda: not p.requests)  # decode gave the blocks up
            assert_empty(p)
            assert_empty(d)
    finally:
        p.shutdown()
        d.shutdown()
