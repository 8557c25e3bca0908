"""The connector's worker side with real transfer engines over TCP (no vLLM needed): decode
reads prefill's blocks byte for byte, refuses what it must not use, the pool round-trips
blocks between two engines through a real store, a stopped prefill delays nothing but its own
reads, and a transfer that cannot be stopped keeps its blocks from vLLM until it settles."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from kvconnect.store.client import StoreClient
from kvconnect.store.config import StoreClientConfig
from kvconnect.store.launch import Cluster
from kvconnect.transfer import TransferConfig, TransferOp
from kvconnect.transfer.datapath.copying import Copier, CopyWorkers
from kvconnect.vllm import worker as worker_module
from kvconnect.vllm.config import VllmConnectorConfig, parse_config
from kvconnect.vllm.groups import FULL_ONLY
from kvconnect.vllm.lookup import PoolLookups
from kvconnect.vllm.params import RemotePrefill
from kvconnect.vllm.pd import LeaseKeeper, PrefillService
from kvconnect.vllm.plan import PoolJob, RecvJob, StepPlan
from kvconnect.vllm.pool import StorePoolIndex
from kvconnect.vllm.roles import SchedulerServices
from kvconnect.vllm.sidechannel import SideChannelClient
from kvconnect.vllm.trace import Phase, parse_line
from kvconnect.vllm.worker import ConnectorWorker
from tests.support.prefill_peer import (
    BLOCKS,
    FORMAT,
    PrefillPeer,
    block_digest,
    decode_worker,
    kv_caches,
)
from tests.support.waiting import wait_for

torch = pytest.importorskip("torch")

TOKEN = os.environ["KVCONNECT_TOKEN"]  # set by tests/conftest.py
SETTINGS = {"transport": "tcp", "read_timeout": 5.0, "rpc_timeout": 1.0}
CONFIG = VllmConnectorConfig.from_mapping(SETTINGS)


def configured(**settings: Any) -> VllmConnectorConfig:
    """``CONFIG`` with ``settings`` (kv_connector_extra_config keys) on top."""
    return VllmConnectorConfig.from_mapping({**SETTINGS, **settings})


def block(cache: Any, index: int, layout: str = "kv_first") -> Any:
    return cache[:, index] if layout == "kv_first" else cache[index]


def wait_results(worker: ConnectorWorker, timeout: float = 10.0) -> tuple[set[str], set[str]]:
    """The first step's ``(finished_recving, failed_recving)`` that is not empty."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _sending, recving, failed = worker.results(set())
        if recving:
            return recving, failed
        time.sleep(0.01)
    raise AssertionError("no result")


def wait_sent(worker: ConnectorWorker, request_id: str, timeout: float = 10.0) -> None:
    """Finish ``request_id`` (its save holds its blocks) and wait until they are released."""
    finished = {request_id}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sending, _recving, _failed = worker.results(finished)
        if request_id in sending:
            return
        finished = set()
        time.sleep(0.01)
    raise AssertionError(f"{request_id}'s blocks were not released")


@pytest.fixture
def prefill() -> Iterator[tuple[ConnectorWorker, PrefillService, dict[str, Any]]]:
    caches = kv_caches(seed=1)
    worker = ConnectorWorker(CONFIG, FORMAT, BLOCKS)
    service = PrefillService("prefill", "127.0.0.1", 0, lease=30, token=TOKEN)
    try:
        service.set_layouts({0: worker.register(caches)})
        service.start()
        yield worker, service, caches
    finally:
        service.close()
        worker.close()


@pytest.fixture
def decode() -> Iterator[tuple[ConnectorWorker, dict[str, Any]]]:
    with decode_worker(CONFIG) as pair:
        yield pair


def _job(service: PrefillService, local: tuple[int, ...], remote: tuple[int, ...]) -> RecvJob:
    target = RemotePrefill("prefill", "p1", "127.0.0.1", service.port, (remote,), 1, None)
    return RecvJob("d1", target, (local,), (remote,))


def test_decode_reads_prefill_blocks_byte_for_byte(prefill: Any, decode: Any) -> None:
    _, service, p_caches = prefill
    d_worker, d_caches = decode
    service.hold("p1")
    d_worker.start(StepPlan(recv=(_job(service, (5, 6, 9), (1, 2, 3)),)))
    recving, failed = wait_results(d_worker)
    assert (recving, failed) == ({"d1"}, set())
    for name, cache in d_caches.items():
        for local, remote in ((5, 1), (6, 2), (9, 3)):
            assert torch.equal(block(cache, local), block(p_caches[name], remote))
        untouched = [i for i in range(BLOCKS) if i not in (5, 6, 9)]
        assert all(not block(cache, i).any() for i in untouched)
    assert service.take_released() == ["p1"], "the confirmation frees prefill's blocks"
    assert d_worker.stats.take()["pd_bytes"] == 3 * 2 * 2 * 4 * 2 * 8 * 4


def test_a_read_is_traced_phase_by_phase_once_vllm_collected_it(
    prefill: Any, decode: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _, service, _ = prefill
    d_worker, _ = decode
    service.hold("p1")
    with caplog.at_level(logging.DEBUG, logger="kvconnect.vllm.worker"):
        d_worker.start(StepPlan(recv=(_job(service, (5, 6), (1, 2)),)))
        wait_results(d_worker)
    traces = [t for r in caplog.records if (t := parse_line(r.getMessage())) is not None]
    nbytes = 2 * 2 * 2 * 4 * 2 * 8 * 4
    assert len(traces) == 1
    assert traces[0]["ok"] == 1
    assert traces[0]["bytes"] == nbytes
    assert {f"{phase}_ms" for phase in Phase} <= set(traces[0])
    stats = d_worker.stats.take()
    assert {f"pd_phase_{phase}_seconds" for phase in Phase} <= set(stats)
    assert stats["pd_phase_read_seconds"] <= stats["pd_seconds"]


def test_an_idle_step_waits_only_while_a_read_runs(
    prefill: Any, decode: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, service, _ = prefill
    d_worker, _ = decode
    waits: list[float] = []
    wait = d_worker._reported.wait
    monkeypatch.setattr(d_worker._reported, "wait", lambda t: waits.append(t) or wait(t))
    d_worker.idle(StepPlan(idle=True))
    assert waits == [], "nothing in flight: vLLM steps on at once"
    service.hold("p1")
    d_worker.start(StepPlan(recv=(_job(service, (5,), (1,)),)))
    d_worker.idle(StepPlan())
    assert waits == [], "vLLM ran a forward pass this step: never held up"
    recving: set[str] = set()
    deadline = time.monotonic() + 10
    while not recving and time.monotonic() < deadline:
        d_worker.idle(StepPlan(idle=True))
        _sending, recving, _failed = d_worker.results(set())
    assert recving == {"d1"}
    assert set(waits) == {CONFIG.idle_wait}, "it waited, at most idle_wait"
    before = len(waits)
    d_worker.idle(StepPlan(idle=True))
    assert len(waits) == before, "the read was collected: nothing to wait for"


def test_a_read_after_the_lease_lapsed_is_a_load_error(decode: Any) -> None:
    d_worker, _ = decode
    caches = kv_caches(seed=2)
    worker = ConnectorWorker(CONFIG, FORMAT, BLOCKS)
    service = PrefillService("prefill", "127.0.0.1", 0, lease=0.1, token=TOKEN)
    try:
        service.set_layouts({0: worker.register(caches)})
        service.start()
        service.hold("p1")
        time.sleep(0.3)  # decode comes too late: prefill may have reused the blocks
        d_worker.start(StepPlan(recv=(_job(service, (4,), (2,)),)))
        assert wait_results(d_worker) == ({"d1"}, {"d1"})
        assert d_worker.load_errors() == {4}
    finally:
        service.close()
        worker.close()


def test_incompatible_prefill_is_refused(decode: Any) -> None:
    d_worker, d_caches = decode
    other = ConnectorWorker(CONFIG, replace(FORMAT, dtype="bfloat16"), BLOCKS)
    service = PrefillService("prefill", "127.0.0.1", 0, lease=30, token=TOKEN)
    try:
        service.set_layouts({0: other.register(kv_caches(seed=3))})
        service.start()
        service.hold("p1")
        d_worker.start(StepPlan(recv=(_job(service, (1,), (1,)),)))
        assert wait_results(d_worker) == ({"d1"}, {"d1"})
        assert d_worker.load_errors() == {1}
        assert not any(c.any() for c in d_caches.values()), "nothing was read"
        released: list[str] = []  # the give-up is sent after the result is reported
        wait_for(
            lambda: bool(released.extend(service.take_released())) or released == ["p1"],
            "decode gave the blocks up",
        )
    finally:
        service.close()
        other.close()


def test_unreachable_prefill_fails_within_the_timeouts(decode: Any) -> None:
    d_worker, _ = decode
    service = PrefillService("prefill", "127.0.0.1", 0, lease=30, token=TOKEN)
    service.start()
    service.close()  # prefill is gone before decode reads
    d_worker.start(StepPlan(recv=(_job(service, (1,), (1,)),)))
    assert wait_results(d_worker, timeout=15) == ({"d1"}, {"d1"})
    assert d_worker.load_errors() == {1}
    stats = d_worker.stats.take()
    assert (stats["pd_reads"], stats["pd_failed"], stats["pd_bytes"]) == (1, 1, 0)
    assert stats["pd_seconds"] > 0, "the time spent failing is counted"


@pytest.mark.parametrize("layout", ["kv_first", "blocks_first"])
def test_pool_blocks_round_trip_between_engines(layout: str) -> None:
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        config = configured(pool=True, master=cluster.master_endpoint)
        writer, reader = (
            ConnectorWorker(config, FORMAT, BLOCKS),
            ConnectorWorker(config, FORMAT, BLOCKS),
        )
        try:
            source, target = kv_caches(seed=4, layout=layout), kv_caches(None, layout=layout)
            writer.register(source)
            reader.register(target)
            writer.save(StepPlan(save=(PoolJob("w", ("h1", "h2"), ((3, 8),)),)))
            # "w" is preempted: the next forward may overwrite its blocks once protect returns
            writer.protect(StepPlan(preempted=("w",)))
            writer.results(set())
            assert writer.stats.data["pool_bytes_saved"] == 2 * 2 * 512  # blocks x layers x bytes
            reader.start(StepPlan(load=(PoolJob("r", ("h1", "h2", "h3"), ((1, 2, 5),)),)))
            recving, failed = wait_results(reader)
            assert (recving, failed) == ({"r"}, {"r"}), "h3 was never saved"
            assert reader.load_errors() == {5}
            for name in target:  # block 0 is vLLM's null block: never a pool block's
                assert torch.equal(block(target[name], 1, layout), block(source[name], 3, layout))
                assert torch.equal(block(target[name], 2, layout), block(source[name], 8, layout))
        finally:
            writer.close()
            reader.close()


def test_a_block_is_one_object_written_as_parts_by_every_rank() -> None:
    """Each TP rank writes its layers' K and V of a block as its part of ONE object: the
    scheduler's lookup (one key per block) sees a block only once every rank's part is in,
    and each rank loads back exactly its own part, byte for byte."""
    hashes = ("h1", "h2", "h3")
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        config = configured(pool=True, master=cluster.master_endpoint)
        ranks = [
            ConnectorWorker(config, replace(FORMAT, tp_rank=rank, tp_size=2), BLOCKS)
            for rank in (0, 1)
        ]
        readers = [
            ConnectorWorker(config, replace(FORMAT, tp_rank=rank, tp_size=2), BLOCKS)
            for rank in (0, 1)
        ]
        store = StoreClient(StoreClientConfig(master=cluster.master_endpoint))
        services = SchedulerServices(config)
        sources = [kv_caches(seed=10 + rank) for rank in (0, 1)]
        targets = [kv_caches(seed=None) for _ in (0, 1)]
        try:
            layouts = {rank: w.register(sources[rank]) for rank, w in enumerate(ranks)}
            for reader, target in zip(readers, targets, strict=True):
                reader.register(target)
            store.start()
            index = StorePoolIndex(store, groups=FULL_ONLY, block_size=FORMAT.block_size)
            services.pool = PoolLookups(index)
            services.set_layouts(layouts)
            assert index.keys is not None
            assert index.leading(hashes, 0) == 0, "nothing saved yet"
            for count, worker in enumerate(ranks, 1):
                worker.save(StepPlan(save=(PoolJob("w", hashes, ((3, 4, 5),)),)))
                worker.protect(StepPlan(preempted=("w",)))  # waits for the save
                assert worker.results({"w"})[0] == {"w"}
                assert index.leading(hashes, 0) == (0 if count == 1 else 3), "a partial block hit"
            assert store.stats().keys == len(hashes), "one object per block"
            for reader in readers:
                reader.start(StepPlan(load=(PoolJob("r", hashes[:2], ((1, 2),)),)))
                assert wait_results(reader) == ({"r"}, set())
            for source, target in zip(sources, targets, strict=True):
                for name in source:
                    for local, saved in ((1, 3), (2, 4)):
                        assert torch.equal(block(target[name], local), block(source[name], saved))
            assert store.remove(index.keys.block_key("h3")).name == "OK"  # h1, h2 are leased
            assert index.leading(hashes, 0) == 2, "the hit stops before the missing block"
        finally:
            services.close()
            store.close()
            for worker in (*ranks, *readers):
                worker.close()


def test_a_save_on_cuda_waits_for_the_forward_pass_on_its_io_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA the save waits for an event recorded on the model's stream: ``save`` returns
    at once (the model thread never synchronizes) and nothing is read before the event."""
    fence = Fence()
    monkeypatch.setattr(worker_module, "record_fence", lambda: fence)
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        config = configured(pool=True, master=cluster.master_endpoint)
        worker = ConnectorWorker(config, FORMAT, BLOCKS)
        store = StoreClient(StoreClientConfig(master=cluster.master_endpoint))
        try:
            worker.register(kv_caches(seed=6))
            worker._cuda = True  # what register() finds for CUDA tensors
            store.start()
            worker.save(StepPlan(save=(PoolJob("w", ("h1",), ((3,),)),)))
            assert fence.waiting.wait(10), "the save's thread did not wait for the event"
            assert store.stats().pending == store.stats().keys == 0, "read before the event"
            assert worker.results({"w"})[0] == set(), "the blocks went back before the save"
            fence.done.set()
            wait_sent(worker, "w")
            assert store.stats().keys == 1
        finally:
            fence.done.set()
            store.close()
            worker.close()


@pytest.mark.gpu
def test_a_cuda_save_stores_what_the_forward_pass_wrote() -> None:
    """The model's stream still has the writes of a block queued when ``save`` returns; the
    stored block is what they wrote (the save waited for their event)."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    expected = kv_caches(seed=8)
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        config = configured(pool=True, master=cluster.master_endpoint)
        writer = ConnectorWorker(config, FORMAT, BLOCKS)
        reader = ConnectorWorker(config, FORMAT, BLOCKS)
        try:
            caches = {name: torch.zeros_like(t, device="cuda") for name, t in expected.items()}
            writer.register(caches)
            target = kv_caches(None)
            reader.register(target)
            busy = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):  # queued ahead of the writes: they land well after save()
                busy = busy @ busy
            for name, tensor in expected.items():
                caches[name].copy_(tensor.pin_memory(), non_blocking=True)
            writer.save(StepPlan(save=(PoolJob("w", ("h1",), ((3,),)),)))
            wait_sent(writer, "w", timeout=60)
            reader.start(StepPlan(load=(PoolJob("r", ("h1",), ((1,),)),)))
            assert wait_results(reader) == ({"r"}, set())
            for name in expected:
                assert torch.equal(block(target[name], 1), block(expected[name], 3))
        finally:
            writer.close()
            reader.close()


def test_a_request_with_two_saves_keeps_its_blocks_until_both_are_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A finished request's output save (``pool_save_generated``) may start while its prompt's
    save still runs: its blocks go back only once both are done."""
    fences = [Fence(), Fence()]
    monkeypatch.setattr(worker_module, "record_fence", iter(fences).__next__)
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        config = configured(pool=True, master=cluster.master_endpoint)
        worker = ConnectorWorker(config, FORMAT, BLOCKS)
        store = StoreClient(StoreClientConfig(master=cluster.master_endpoint))
        try:
            worker.register(kv_caches(seed=7))
            worker._cuda = True  # each step's saves wait for that step's event
            store.start()
            worker.save(StepPlan(save=(PoolJob("w", ("prompt",), ((3,),)),)))
            worker.save(StepPlan(save=(PoolJob("w", ("output",), ((4,),)),)))
            fences[0].done.set()
            wait_for(lambda: store.stats().keys == 1, "the prompt's save did not finish")
            steps = Steps(worker, finished={"w"})
            wait_for(
                lambda: steps.step() or worker.stats.data.get("pool_saves") == 1,
                "the prompt's save was not reported",
            )
            assert not steps.sending, "blocks handed back while the output's save reads them"
            fences[1].done.set()
            wait_sent(worker, "w")
            assert store.stats().keys == 2
        finally:
            for fence in fences:
                fence.done.set()
            store.close()
            worker.close()


class Fence:
    """A CUDA event stand-in whose work ends when the test says."""

    def __init__(self) -> None:
        self.waiting = threading.Event()
        self.done = threading.Event()

    def synchronize(self) -> None:
        self.waiting.set()
        self.done.wait(30)


def test_a_dead_prefill_is_reported_before_the_give_up_call_times_out() -> None:
    """Decode reports a failed read at once; telling prefill to free its blocks, a call a dead
    prefill never answers, comes after (else a dead prefill would delay every recompute)."""
    silent_rpc = 6.0
    caches = kv_caches(seed=5)
    prefill = ConnectorWorker(CONFIG, FORMAT, BLOCKS)
    service = PrefillService("prefill", "127.0.0.1", 0, lease=30, token=TOKEN)
    decode = ConnectorWorker(replace(CONFIG, rpc_timeout=silent_rpc), FORMAT, BLOCKS)
    try:
        service.set_layouts({0: prefill.register(caches)})
        service.start()
        decode.register(kv_caches(seed=None))
        service.hold("p1")
        decode.start(StepPlan(recv=(_job(service, (1,), (1,)),)))
        assert wait_results(decode) == ({"d1"}, set())  # decode now knows prefill's layout
        service.hold("p2")
        service.close()
        prefill.close()  # prefill dies with p2's blocks held
        job = _job(service, (2,), (2,))
        decode.start(
            StepPlan(
                recv=(replace(job, request_id="d2", remote=replace(job.remote, request_id="p2")),)
            )
        )
        assert wait_results(decode, timeout=silent_rpc - 2) == ({"d2"}, {"d2"})
        assert decode.load_errors() == {2}
        stats = decode.stats.take()
        assert (stats["pd_reads"], stats["pd_failed"]) == (2, 1)
        assert stats["pd_bytes"] == 2 * 2 * 4 * 2 * 8 * 4, "bytes of the first read only"
    finally:
        decode.close()
        service.close()
        prefill.close()


def test_worker_engines_take_transfer_settings_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVCONNECT_TRANSFER_TCP_STREAMS", raising=False)
    for expected in (TransferConfig().tcp_streams, 3):
        worker = ConnectorWorker(parse_config(SETTINGS), FORMAT, BLOCKS)
        try:
            assert worker.engine.config.tcp_streams == expected
            assert worker.engine.config.connect_timeout == CONFIG.transfer.connect_timeout
        finally:
            worker.close()
        monkeypatch.setenv("KVCONNECT_TRANSFER_TCP_STREAMS", "3")


def test_store_and_transfer_sections_reach_the_pool_client_and_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clients: list[StoreClient] = []

    class Recorded(StoreClient):
        def start(self) -> None:
            clients.append(self)
            super().start()

    monkeypatch.setattr(worker_module, "StoreClient", Recorded)
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        extra = {
            **SETTINGS,
            "pool": True,
            "master": cluster.master_endpoint,
            "store": {"replicas": 2},
            "transfer": {"tcp_streams": 3},
        }
        worker = ConnectorWorker(parse_config(extra, environ={}), FORMAT, BLOCKS)
        try:
            worker.register(kv_caches(seed=None))
            (client,) = clients
            assert (client.config.replicas, client.config.master) == (2, cluster.master_endpoint)
            assert client.config.rpc_timeout == 0.5, "the connector's pool_rpc_timeout default"
            assert worker.engine.config.tcp_streams == 3
            assert client.engine is worker.engine
        finally:
            worker.close()


def _kvconnect_threads() -> dict[int, str]:
    """Native id → name of the live threads kvconnect started."""
    return {
        t.native_id: t.name
        for t in threading.enumerate()
        if t.name.startswith("kvconnect") and t.native_id is not None
    }


def test_io_cpus_places_the_workers_threads_and_leaves_the_model_thread_alone() -> None:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        pytest.skip("needs two CPUs and sched_setaffinity")
    model_core, io_core = cpus[0], cpus[-1]
    before = set(_kvconnect_threads())
    seen: dict[str, Any] = {}

    def model_thread() -> None:  # pinned as vLLM pins its CPU worker's model thread
        os.sched_setaffinity(0, {model_core})
        worker = ConnectorWorker(replace(CONFIG, io_cpus=str(io_core)), FORMAT, BLOCKS)
        try:
            worker.register(kv_caches(seed=1))
            started = {t: n for t, n in _kvconnect_threads().items() if t not in before}
            seen["threads"] = {n: os.sched_getaffinity(t) for t, n in started.items()}
            seen["model"] = os.sched_getaffinity(0)
        finally:
            worker.close()

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    assert seen["threads"], "register starts the engine's listener"
    assert all(mask == {io_core} for mask in seen["threads"].values()), seen["threads"]
    assert seen["model"] == {model_core}


# --------------------------------------------------------------- a prefill that hangs


def test_a_stopped_prefill_delays_no_other_read_load_or_save() -> None:
    """A SIGSTOPped prefill accepts connections and answers nothing: reads from it hang until
    their deadline. More of them than a shared thread pool has threads must not delay a read
    from another prefill, nor the pool's saves and loads."""
    settings = {"read_timeout": 60.0, "rpc_timeout": 30.0, "connect_timeout": 30.0, "pool": True}
    with (
        Cluster(servers=1, server_size=8 << 20) as cluster,
        PrefillPeer(seed=1) as stuck,
        PrefillPeer(seed=2) as healthy,
    ):
        caches = kv_caches(seed=None)
        config = configured(**settings, master=cluster.master_endpoint)
        decode = ConnectorWorker(config, FORMAT, BLOCKS)
        stopped = False
        try:
            decode.register(caches)
            stuck.hold("warm")  # decode knows the stuck prefill: its reads hang in the READ
            decode.start(
                StepPlan(recv=(RecvJob("warm", stuck.remote("warm", (0,)), ((0,),), ((0,),)),))
            )
            assert wait_results(decode) == ({"warm"}, set())
            hung = tuple(
                RecvJob(f"s{i}", stuck.remote(f"p{i}", (i,)), ((i,),), ((i,),)) for i in range(1, 6)
            )
            for job in hung:
                stuck.hold(job.remote.request_id)
            healthy.hold("h")
            os.kill(stuck.pid, signal.SIGSTOP)
            stopped = True
            decode.start(StepPlan(recv=hung))
            decode.start(
                StepPlan(recv=(RecvJob("h", healthy.remote("h", (2, 3)), ((8, 9),), ((2, 3),)),))
            )
            assert wait_results(decode) == ({"h"}, set()), "the healthy read comes first"
            assert block_digest(caches, (8, 9)) == healthy.digest((2, 3))
            decode.save(StepPlan(save=(PoolJob("v", ("x",), ((8,),)),)))
            wait_sent(decode, "v")
            decode.start(StepPlan(load=(PoolJob("l", ("x",), ((10,),)),)))
            assert wait_results(decode) == ({"l"}, set())
            assert block_digest(caches, (10,)) == healthy.digest((2,))

            os.kill(stuck.pid, signal.SIGCONT)
            stopped = False
            done: set[str] = set()
            while len(done) < len(hung):
                recving, failed = wait_results(decode, timeout=60)
                assert not failed
                done |= recving
            assert done == {job.request_id for job in hung}
            for job in hung:
                assert block_digest(caches, job.local_blocks[0]) == stuck.digest(
                    job.remote_blocks[0]
                )
        finally:
            if stopped:
                os.kill(stuck.pid, signal.SIGCONT)
            decode.close()


def test_a_stopped_prefill_delays_no_other_lease_renewal() -> None:
    """Decode's scheduler renews the leases of every prefill it waits for; one that does not
    answer (each call waits for the 30 s timeout) must not hold up the renewals of another."""
    client = SideChannelClient(timeout=30.0, token=TOKEN)
    keeper = LeaseKeeper(client, lease=0.6)  # a renewal round every 0.1 s
    with PrefillPeer(seed=1) as stuck, PrefillPeer(seed=2) as healthy:
        stopped = False
        try:
            stuck.hold("s")
            healthy.hold("h")
            os.kill(stuck.pid, signal.SIGSTOP)
            stopped = True
            keeper.track("ds", stuck.remote("s", (1,)))
            keeper.track("dh", healthy.remote("h", (1,)))
            keeper.start()
            wait_for(
                lambda: healthy.renewals().get("h", 0) >= 5,
                "the healthy prefill's lease is renewed round after round",
                timeout=20,
            )
            os.kill(stuck.pid, signal.SIGCONT)
            stopped = False
            wait_for(lambda: stuck.renewals().get("s", 0) >= 1, "the stuck renewal arrives")
        finally:
            if stopped:
                os.kill(stuck.pid, signal.SIGCONT)
            keeper.close()
            client.close()


# ------------------------------------------------- transfers that cannot be stopped


class Gate:
    """Holds every copy of the local and shared-memory transports while closed: a transport
    thread that keeps a transfer's memory past its deadline and the settle grace."""

    def __init__(self) -> None:
        self.held = threading.Semaphore(0)  # released once per held copy
        self._open = threading.Event()
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def pass_through(self) -> None:
        if not self._open.is_set():
            self.held.release()
            self._open.wait()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    gate = Gate()
    original = Copier.copy

    def copy(self: Copier, op: TransferOp, work: Any) -> Any:
        gate.pass_through()
        return original(self, op, work)

    monkeypatch.setattr(Copier, "copy", copy)
    # Gated copies are a transport thread's: none runs inline in the caller.
    monkeypatch.setattr(CopyWorkers, "inline", lambda _workers, _group: False)
    try:
        yield gate
    finally:
        gate.open()


def _unsettled(caplog: pytest.LogCaptureFixture, *request_ids: str) -> bool:
    """The worker found each request's transfer unsettled after its deadline."""
    messages = [r.getMessage() for r in caplog.records]
    return all(any(f" of {rid} could not be stopped" in m for m in messages) for rid in request_ids)


class Steps:
    """Collects what the worker reports at the end of each step."""

    def __init__(self, worker: ConnectorWorker, finished: set[str] | None = None) -> None:
        self._worker = worker
        self._finished = finished or set()  # requests the scheduler finished (next step)
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.failed: set[str] = set()
        self.load_errors: set[int] = set()

    def step(self) -> bool:
        """One step's results; whether anything was reported so far."""
        sending, recving, failed = self._worker.results(self._finished)
        self._finished = set()
        self.sending |= sending
        self.recving |= recving
        self.failed |= failed
        self.load_errors |= self._worker.load_errors()
        return bool(self.sending or self.recving)


def test_a_read_that_cannot_be_stopped_keeps_its_blocks_until_it_settles(
    prefill: Any, gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    """A READ whose transport thread still writes decode's blocks after the deadline: the
    request stays waiting for its KV (vLLM would reuse blocks it sees as failed) and fails
    only once the transfer lets go."""
    caplog.set_level(logging.ERROR, logger="kvconnect")
    _, service, _ = prefill
    config = configured(transport="auto", read_timeout=0.5)  # same process: local copies
    decode = ConnectorWorker(config, FORMAT, BLOCKS)
    try:
        decode.register(kv_caches(seed=None))
        service.hold("p1")
        gate.close()
        decode.start(StepPlan(recv=(_job(service, (5, 6), (1, 2)),)))
        assert gate.held.acquire(timeout=10), "the copy started"
        steps = Steps(decode)
        wait_for(
            lambda: steps.step() or _unsettled(caplog, "d1"),
            "the read outlives its deadline and the settle grace",
            timeout=30,
        )
        assert not steps.step(), "reported while the copy still writes the blocks"
        assert not steps.load_errors
        gate.open()
        wait_for(steps.step, "the read is reported once it settled")
        assert (steps.recving, steps.failed, steps.load_errors) == ({"d1"}, {"d1"}, {5, 6})
    finally:
        gate.open()
        decode.close()


def test_pool_transfers_that_cannot_be_stopped_keep_their_blocks_until_they_settle(
    gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    """A pool load still writing its blocks, a save still reading its blocks after their
    deadlines: neither request is reported (load: finished_recving; save: finished_sending,
    which frees the blocks) before the transfer settled."""
    caplog.set_level(logging.ERROR, logger="kvconnect")
    with Cluster(servers=1, server_size=8 << 20) as cluster:
        config = configured(
            transport="auto",  # the store server is on this host: shared-memory copies
            pool=True,
            master=cluster.master_endpoint,
            pool_read_timeout=0.5,
            pool_write_timeout=0.5,
        )
        worker = ConnectorWorker(config, FORMAT, BLOCKS)
        try:
            worker.register(kv_caches(seed=4))
            worker.save(StepPlan(save=(PoolJob("w", ("h1",), ((3,),)),)))
            wait_sent(worker, "w")
            gate.close()
            worker.start(StepPlan(load=(PoolJob("r", ("h1",), ((1,),)),)))
            worker.save(StepPlan(save=(PoolJob("v", ("h2",), ((4,),)),)))
            for _ in range(2):
                assert gate.held.acquire(timeout=10), "both copies started"
            steps = Steps(worker, finished={"v"})  # "v" finished: only its save holds it
            wait_for(
                lambda: steps.step() or _unsettled(caplog, "r", "v"),
                "the load and the save outlive their deadlines and the settle grace",
                timeout=30,
            )
            assert not steps.step(), "blocks handed back while copies still use them"
            gate.open()
            wait_for(
                lambda: steps.step() and bool(steps.sending and steps.recving),
                "the load and the save are reported once settled",
            )
            assert (steps.sending, steps.recving, steps.failed) == ({"v"}, {"r"}, {"r"})
            assert steps.load_errors == {1}
        finally:
            gate.open()
            worker.close()
