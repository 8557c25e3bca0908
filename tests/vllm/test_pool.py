"""The pool's key scheme and fleet probe (kvconnect/vllm/pool.py) against a real master and
store server, every environment: instances that hash blocks alike agree, one that does not is
refused with one ERROR, a store that cannot answer leaves the question open (one WARNING saying
why), an instance finding another writing the probe reads theirs, the probe is the home
cluster's alone (federation), the probe waits for vLLM's seeded hashes and settles in the
background before any lookup, and ranks whose KV formats differ get no key scheme."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import pytest

from kvconnect.store.client import StoreClient
from kvconnect.store.config import PeerConfig, StoreClientConfig
from kvconnect.store.launch import Cluster
from kvconnect.store.messages import Code
from kvconnect.vllm.groups import FULL_ONLY
from kvconnect.vllm.layout import KVFormat, LayerLayout, RankLayout
from kvconnect.vllm.lookup import PoolLookups
from kvconnect.vllm.pool import StorePoolIndex, Verdict, block_part, fleet_keys, pool_keys
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
FORMAT = KVFormat("vllm 0.33.0", "org/m", "", "bfloat16", 16, 2, "FLASH_ATTN", "NHD")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(servers=1, server_size=8 << 20) as c:
        yield c


@pytest.fixture
def client(cluster: Cluster) -> Iterator[StoreClient]:
    with StoreClient(StoreClientConfig(master=cluster.master_endpoint)) as c:
        yield c


def _index(client: StoreClient, probe: bytes, namespace: str) -> StorePoolIndex:
    index = StorePoolIndex(client, lambda: probe, groups=FULL_ONLY, block_size=16)
    index.keys = pool_keys(namespace=namespace, model="m", compat="c" * 32)
    return index


def test_instances_that_hash_alike_agree_and_another_is_refused_once(
    client: StoreClient, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = _index(client, b"seed-a", "fleet"), _index(client, b"seed-a", "fleet")
    assert first.check_fleet(), "the first instance stores the probe"
    assert second.check_fleet(), "the second finds its own hash there"
    assert first.keys is not None
    assert client.put(first.keys.block_key("h1"), b"block").name == "OK"
    assert second.leading(["h1", "h2"], 0) == 1
    stranger = _index(client, b"seed-b", "fleet")
    with caplog.at_level(logging.ERROR, logger="kvconnect"):
        assert stranger.leading(["h1"], 0) == 0, "a refused instance hit the fleet's blocks"
        assert stranger.leading(["h1"], 0) == 0
    assert stranger.verdict is Verdict.DIFFER
    assert [r.levelname for r in caplog.records if "pool refused" in r.getMessage()] == ["ERROR"]
    assert _index(client, b"seed-b", "another-fleet").check_fleet(), "namespaces are fleets"


def test_a_store_that_cannot_answer_leaves_the_verdict_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    down = StoreClientConfig(master="tcp://127.0.0.1:1", rpc_timeout=0.2)
    with StoreClient(down) as offline, caplog.at_level(logging.WARNING, logger="kvconnect"):
        index = _index(offline, b"seed-a", "open")
        assert not index.check_fleet()
        assert index.verdict is Verdict.UNKNOWN, "decided without an answer"
        assert index.leading(["h1"], 0) == 0
        assert index.verdict is Verdict.UNKNOWN
    warned = [r.getMessage() for r in caplog.records if "got no answer" in r.getMessage()]
    assert len(warned) == 1, "one warning per outage, naming why"
    assert "storing the probe" in warned[0]


def test_an_instance_finding_another_writing_the_probe_reads_theirs(
    client: StoreClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A fleet starting together: the probe's put answers BUSY while another instance's write
    of it is under way; the verdict waits for that write instead of staying open (it used to,
    and the first requests saved nothing)."""
    index = _index(client, b"seed-ab", "together")
    assert index.keys is not None
    _agrees_once_written(index, client, index.keys.probe_key, caplog)


def test_the_fleet_probe_is_the_home_clusters_only(
    cluster: Cluster, client: StoreClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Federation: a peer cluster's fleet is another fleet, which may hash otherwise. With
    home's probe being written and a peer holding another hash under its key, the verdict
    waits for home's (it used to read the peer's: a refusal, or with a like hash a peer hit
    and a copy home); a probe stored home is not copied to a ``copy_writes`` peer."""
    with Cluster(servers=1, server_size=8 << 20) as east:
        peer = PeerConfig(
            name="east", master=east.master_endpoint, copy_home=True, copy_writes=True
        )
        federated = StoreClient(StoreClientConfig(master=cluster.master_endpoint, peers=(peer,)))
        there = StoreClient(StoreClientConfig(master=east.master_endpoint))
        with federated, there:
            together = _index(federated, b"seed-ab", "federated")
            assert together.keys is not None
            key = together.keys.probe_key
            assert there.put(key, b"seed-zz") is Code.OK  # east's fleet hashes otherwise
            _agrees_once_written(together, client, key, caplog)

            alone = _index(federated, b"seed-ab", "federated-alone")
            assert alone.check_fleet()
            assert alone.keys is not None
            assert federated.put("written-home", b"copied") is Code.OK  # queued after the probe

            def copied_out() -> bool:  # counted once the peer's master took it
                copied = federated.peers()[0].counts.copied
                return copied > 0 and there.get("written-home") is not None

            wait_for(copied_out, "no copy to the peer")
            assert bytes(there.get("written-home") or b"") == b"copied"
            assert there.get(alone.keys.probe_key) is None, "the probe was copied to the peer"
            assert bytes(there.get(key) or b"") == b"seed-zz"
            (counts,) = (p.counts for p in federated.peers())
            assert (counts.asked, counts.hits, counts.copied) == (0, 0, 1)


def _agrees_once_written(
    index: StorePoolIndex, writer: StoreClient, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``writer`` (another instance) writes ``index``'s own probe in two parts; between them
    ``index``'s check finds the put under way (BUSY), waits, and agrees once it is in."""
    region = writer.register(bytearray(b"seed-ab"))

    def write(part: int) -> None:
        result = writer.batch_put_part_from(
            [key],
            region,
            [4 * part],
            [4 - part],
            part=part,
            parts=2,
            object_sizes=[7],
            object_offsets=[4 * part],
        )
        assert result.codes == (Code.OK,)

    write(0)
    with ThreadPoolExecutor(1) as pool, caplog.at_level(logging.DEBUG, logger="kvconnect"):
        agreed = pool.submit(index.check_fleet)
        wait_for(lambda: "another instance is writing" in caplog.text, "the probe never waited")
        write(1)
        assert agreed.result(timeout=10), "no agreement once the probe was written"
    assert index.verdict is Verdict.AGREE
    assert "got no answer" not in caplog.text


def test_the_probe_waits_for_vllm_to_seed_its_hashes(client: StoreClient) -> None:
    seeded: list[bytes] = []
    index = StorePoolIndex(
        client, lambda: seeded[0] if seeded else None, groups=FULL_ONLY, block_size=16
    )
    index.keys = pool_keys(namespace="unseeded", model="m", compat="c" * 32)
    assert not index.check_fleet()
    assert index.verdict is Verdict.UNKNOWN
    assert client.get(index.keys.probe_key) is None, "an unseeded hash was stored as the fleet's"
    seeded.append(b"seed-a")
    assert index.check_fleet()
    assert bytes(client.get(index.keys.probe_key) or b"") == b"seed-a"


def test_the_background_probe_settles_the_verdict_before_any_lookup(client: StoreClient) -> None:
    asks = [0]

    def probe() -> bytes | None:
        asks[0] += 1
        return b"seed-a" if asks[0] > 3 else None  # vLLM seeds its hashes a moment later

    index = StorePoolIndex(client, probe, groups=FULL_ONLY, block_size=16)
    index.keys = pool_keys(namespace="settled", model="m", compat="c" * 32)
    with closing(PoolLookups(index)) as lookups:
        lookups.settle()
        wait_for(lambda: index.verdict is Verdict.AGREE, "the background probe never decided")
    assert bytes(client.get(index.keys.probe_key) or b"") == b"seed-a"


def test_closing_stops_a_background_probe_the_store_cannot_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    down = StoreClientConfig(master="tcp://127.0.0.1:1", rpc_timeout=0.2)
    with StoreClient(down) as offline, caplog.at_level(logging.WARNING, logger="kvconnect"):
        index = _index(offline, b"seed-a", "open")
        lookups = PoolLookups(index)
        lookups.settle()
        wait_for(lambda: "got no answer" in caplog.text, "the background probe never asked")
        lookups.close()  # returns within one ask: the leak check finds no probe thread
        assert index.verdict is Verdict.UNKNOWN


def test_ranks_whose_kv_formats_differ_get_no_key_scheme(caplog: pytest.LogCaptureFixture) -> None:
    layer = LayerLayout("l0", 1, 0, 2, 4096, 8, 512, 512)
    same = {r: RankLayout(f"s{r}", "c" * 32, (layer,), FORMAT) for r in (0, 1)}
    keys = fleet_keys(namespace="", layouts=same)
    assert keys is not None
    assert keys.block_key("ab", group=1) == f"vllm/org--m/{'c' * 32}/ab/g1"  # model org/m
    differ = {0: same[0], 1: RankLayout("s1", "d" * 32, (layer,), FORMAT)}
    assert fleet_keys(namespace="", layouts=differ) is None
    assert "pool disabled" in caplog.text
    part = block_part([layer, layer], tp_rank=1, tp_size=2)
    assert (part.part_bytes, part.object_offset, part.object_bytes) == (2048, 2048, 4096)
