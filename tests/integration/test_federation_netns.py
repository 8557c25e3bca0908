"""Federation across a real link: the peer cluster (master and store server) runs in its own
network namespace behind a veth pair; home cluster and client run here. Over an impaired
link (rate-limited, lossy) peer reads stay byte-exact; a partition (every packet into the
peer's namespace dropped: no refusal, only silence) costs one bounded attempt, after which
home reads never wait on the peer, and healing brings the peer back through the probe."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconnect.store.client import StoreClient
from kvconnect.store.config import PeerConfig, StoreClientConfig
from kvconnect.store.launch import Cluster
from kvconnect.store.messages import Code
from kvconnect.store.resilience import BreakerState
from kvconnect.testing.peer import pattern
from kvconnect.transfer import TransferConfig
from tests.support.netns import Namespace, namespace, run_in
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.netns]
MiB = 1 << 20
_TBF = "tbf rate 100mbit burst 64kb latency 50ms"
_DROP_1_PERCENT = "-m statistic --mode random --probability 0.01 -j DROP"


@pytest.fixture
def peer_ns() -> Iterator[Namespace]:
    with namespace("fed", "10.204.0") as ns:
        yield ns


def _token(path: Path) -> str:
    path.write_text(secrets.token_hex(16) + "\n")
    path.chmod(0o600)
    return str(path)


def _values(prefix: str, count: int, size: int) -> dict[str, bytes]:
    return {f"{prefix}{i}": pattern(i + len(prefix), size + i).tobytes() for i in range(count)}


def _impair(ns: Namespace) -> None:
    """tbf 100 Mbit/s on both ends and 1 % of the packets into the namespace dropped (the
    development kernel has no netem; tests/integration/test_netns.py says more)."""
    if shutil.which("iptables") is None or shutil.which("tc") is None:
        pytest.skip("tc and iptables are needed to impair the link")
    try:
        for prefix, dev in (("", ns.outside_dev), (f"-n {ns.name} ", ns.inside_dev)):
            subprocess.run(
                f"tc {prefix}qdisc replace dev {dev} root {_TBF}".split(),
                check=True,
                capture_output=True,
            )
        run_in(
            ns.name,
            f"iptables -A INPUT -i {ns.inside_dev} {_DROP_1_PERCENT}",
        )
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot impair the link: {exc.stderr!r}")


def test_peer_reads_over_an_impaired_link_and_a_partition(
    peer_ns: Namespace, tmp_path: Path
) -> None:
    home_token, peer_token = _token(tmp_path / "home"), _token(tmp_path / "peer")
    with (
        Cluster(1, 32 * MiB, token_file=home_token) as home,
        Cluster(
            1, 32 * MiB, token_file=peer_token, host=peer_ns.inside, netns=peer_ns.name
        ) as peer,
    ):
        at_home, at_peer = _values("h", 4, 64 * 1024), _values("p", 8, 256 * 1024)
        for cluster, values in ((home, at_home), (peer, at_peer)):
            with StoreClient(
                StoreClientConfig(master=cluster.master_endpoint),
                TransferConfig(token_file=cluster.token_file),
            ) as writer:
                for key, value in values.items():
                    assert writer.put(key, value) is Code.OK
        _impair(peer_ns)
        peer_config = PeerConfig(
            name="east",
            master=peer.master_endpoint,
            token_file=peer_token,
            rpc_timeout=5.0,  # a lost packet costs a TCP retransmit (>= 200 ms) on this link
            probe_interval=0.3,
            negative_ttl=0,
        )
        config = StoreClientConfig(
            master=home.master_endpoint, peers=(peer_config,), io_timeout=20.0
        )
        transfer = TransferConfig(token_file=home_token)
        with StoreClient(config, transfer) as client:
            keys = [*at_home, *at_peer]
            size = 512 * 1024
            buffer = bytearray(len(keys) * size)
            region = client.register(buffer)
            offsets = [i * size for i in range(len(keys))]

            def read_all() -> tuple[Code, ...]:
                return client.batch_get_into(keys, region, offsets, [size] * len(keys)).codes

            assert read_all() == (Code.OK,) * len(keys)  # over the impaired link
            for i, value in enumerate([*at_home.values(), *at_peer.values()]):
                assert bytes(buffer[offsets[i] : offsets[i] + len(value)]) == value
            (status,) = client.peers()
            assert status.counts.hits == len(at_peer)

            run_in(peer_ns.name, f"iptables -I INPUT -i {peer_ns.inside_dev} -j DROP")  # partition
            codes = client.batch_get_into(
                keys, region, offsets, [size] * len(keys), timeout=4.0
            ).codes
            assert codes[: len(at_home)] == (Code.OK,) * len(at_home)
            assert all(code is not Code.OK for code in codes[len(at_home) :])
            assert client.peers()[0].breaker is not BreakerState.CLOSED
            asked = client.peers()[0].counts.asked
            buffer[:] = bytes(len(buffer))
            codes = client.batch_get_into(keys, region, offsets, [size] * len(keys)).codes
            assert codes[: len(at_home)] == (Code.OK,) * len(at_home)
            for i, value in enumerate(at_home.values()):
                assert bytes(buffer[offsets[i] : offsets[i] + len(value)]) == value
            assert client.peers()[0].counts.asked == asked  # the partitioned peer was skipped

            run_in(peer_ns.name, f"iptables -D INPUT -i {peer_ns.inside_dev} -j DROP")  # healed
            wait_for(
                lambda: client.peers()[0].breaker is BreakerState.CLOSED, "probe after heal", 30
            )
            wait_for(lambda: read_all() == (Code.OK,) * len(keys), "peer reads after heal", 30)
            for i, value in enumerate(at_peer.values(), start=len(at_home)):
                assert bytes(buffer[offsets[i] : offsets[i] + len(value)]) == value
