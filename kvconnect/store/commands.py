"""The store's command-line programs: master, store server, both at once, cluster status."""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence

from kvconnect.errors import KVConnectError
from kvconnect.store import messages as m
from kvconnect.store.config import MasterConfig, PeerConfig, StoreServerConfig
from kvconnect.store.master.service import MasterService
from kvconnect.store.rpc import RpcClient
from kvconnect.store.server import StoreServer
from kvconnect.transfer import TransferConfig

log = logging.getLogger(__name__)

EXIT_CRASHED = 70  # EX_SOFTWARE: the master's serving loop failed; a supervisor restarts us


def wait_for_signal(failed: Callable[[], bool] = lambda: False) -> None:
    """Block until SIGINT or SIGTERM, or until ``failed()`` (checked every 0.2 s)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.2) and not failed():
        pass


def _freeze_startup_heap() -> None:
    """Move everything alive after start-up (modules, the recovered state) out of the cyclic
    collector's reach: its full collections then walk only later objects, where every module's
    objects made each one a pause of 15-35 ms for every caller of this process."""
    gc.collect()
    gc.freeze()


def run_master(config: MasterConfig) -> int:
    """``kvconnect master``; exits EXIT_CRASHED if its serving loop fails."""
    config = _with_token(config)
    service = MasterService(config)
    endpoint = service.start()
    _freeze_startup_heap()
    print(f"kvconnect master listening on {endpoint}", flush=True)
    try:
        wait_for_signal(lambda: service.crashed is not None)
    finally:
        service.close()
    return EXIT_CRASHED if service.crashed is not None else 0


def _with_token(config: MasterConfig) -> MasterConfig:
    """``config`` with its cluster token resolved (generated if none is configured)."""
    token = config.cluster_token()
    if token is None:
        log.warning(
            "the master runs WITHOUT authentication (insecure): anyone who reaches it "
            "can mount, remove and list"
        )
    return config.replace(token=token)


def run_store(config: StoreServerConfig, transfer: TransferConfig) -> int:
    """``kvconnect store``."""
    with StoreServer(config, transfer) as server:
        _freeze_startup_heap()
        print(f"kvconnect store server {server.spec.name}: {config.size} bytes", flush=True)
        wait_for_signal()
    return 0


def run_serve(master: MasterConfig, store: StoreServerConfig, transfer: TransferConfig) -> int:
    """``kvconnect serve``: a master and one store server in this process (one token)."""
    master = _with_token(master)
    if transfer.token is None and not transfer.token_file:
        transfer = transfer.replace(token=master.token, insecure=master.token is None)
    service = MasterService(master)
    endpoint = service.start()
    try:
        with StoreServer(store.replace(master=endpoint), transfer) as server:
            _freeze_startup_heap()
            print(f"kvconnect serving: master {endpoint}, store {server.spec.name}", flush=True)
            wait_for_signal(lambda: service.crashed is not None)
    finally:
        service.close()
    return EXIT_CRASHED if service.crashed is not None else 0


def run_status(
    endpoint: str, timeout: float, token: str | None, peers: Sequence[PeerConfig] = ()
) -> int:
    """``kvconnect status``: print the cluster's segments, usage and keys, the peer clusters
    its clients use (as they report them), then whether each of ``peers`` answers (exit
    status 1 if home does not; a peer that does not is shown)."""
    reply = _stats(endpoint, timeout, token)
    if not isinstance(reply, m.StatsReply):
        print(f"unexpected reply: {reply!r}")
        return 1
    term = f" (leader, term {reply.term})" if reply.term else ""
    print(
        f"master {endpoint}{term}: {reply.keys} keys, {reply.pending} pending puts, "
        f"{reply.bytes_stored} bytes stored, {reply.evictions} evictions; "
        f"{reply.connections} client connections, {reply.refused} refused (no cluster token), "
        f"{reply.dropped} messages dropped"
    )
    _print_tiers(reply.tiers)
    if reply.tenants:
        _print_tenants(reply.tenants)
    print(
        f"{'segment':<40}{'tier':<6}{'server':<28}{'used':>14}{'in transit':>14}"
        f"{'capacity':>14}{'use':>7}{'objects':>10}"
    )
    for s in reply.segments:
        share = s.used / s.capacity if s.capacity else 0.0
        print(
            f"{s.name:<40}{s.tier.name.lower():<6}{s.server:<28}{s.used:>14}{s.in_transit:>14}"
            f"{s.capacity:>14}{share:>7.1%}{s.objects:>10}"
        )
    if reply.peers:
        _print_peer_use(reply.peers)
    if peers:
        _print_peers(peers, timeout)
    return 0


def _stats(endpoint: str, timeout: float, token: str | None) -> m.Reply:
    rpc = RpcClient(endpoint, timeout, token=token)
    try:
        return rpc.call(m.Stats())
    finally:
        rpc.close()


def _print_peer_use(peers: list[m.PeerSummary]) -> None:
    """One line per peer cluster the home cluster's clients reported using in the last 30 s:
    how many have its breaker closed (``up``, asking it) or open (``down``, skipping it), and
    its share of the keys they read (``hits`` over every key read, home's and peers')."""
    print(
        f"{'peer':<16}{'master':<32}{'clients':>8}{'up':>5}{'down':>5}{'hit share':>10}"
        f"{'hits':>10}{'asked':>10}{'failures':>9}{'skipped':>10}{'copied':>9}"
    )
    for p in peers:
        c = p.counts
        share = f"{c.hits / p.reads:.1%}" if p.reads else "-"
        print(
            f"{p.peer:<16}{p.master:<32}{p.clients:>8}{p.clients - p.down:>5}{p.down:>5}"
            f"{share:>10}{c.hits:>10}{c.asked:>10}{c.failures:>9}{c.skipped:>10}{c.copied:>9}"
        )


def _print_peers(peers: Sequence[PeerConfig], timeout: float) -> None:
    """One line per peer cluster: reachable (with the round trip of one stats call) or why
    not, and its keys and memory use, as seen from here."""
    print(f"{'peer':<16}{'master':<32}{'state':<13}{'rtt ms':>8}{'keys':>10}{'used':>16}{'use':>7}")
    for peer in peers:
        started = time.monotonic()
        try:
            reply = _stats(peer.master, min(timeout, peer.rpc_timeout * 5), peer.cluster_token())
        except KVConnectError as exc:
            print(f"{peer.name:<16}{peer.master:<32}unreachable  {exc}")
            continue
        rtt = (time.monotonic() - started) * 1e3
        if not isinstance(reply, m.StatsReply):
            print(f"{peer.name:<16}{peer.master:<32}{'refused':<13}{reply!r}")
            continue
        used = sum(s.used for s in reply.segments)
        capacity = sum(s.capacity for s in reply.segments)
        share = used / capacity if capacity else 0.0
        print(
            f"{peer.name:<16}{peer.master:<32}{'reachable':<13}{rtt:>8.2f}{reply.keys:>10}"
            f"{used:>16}{share:>7.1%}"
        )


def _print_tenants(tenants: list[m.TenantStats]) -> None:
    """The per-tenant table of ``kvconnect status`` (a tenant's token shows its own row)."""
    print(
        f"{'tenant':<20}{'memory':>14}{'quota':>14}{'use':>7}{'disk':>14}{'disk quota':>14}"
        f"{'share':>14}{'objects':>10}{'evicted':>10}"
    )
    for t in tenants:
        use = f"{t.used / t.quota:.1%}" if t.quota else "-"
        print(
            f"{t.name:<20}{t.used:>14}{t.quota:>14}{use:>7}{t.disk_used:>14}{t.disk_quota:>14}"
            f"{t.share:>14}{t.objects:>10}{t.evictions:>10}"
        )


def _print_tiers(tiers: list[m.TierStats]) -> None:
    """The per-tier table of ``kvconnect status``."""
    print(
        f"{'tier':<6}{'capacity':>16}{'used':>16}{'objects':>10}{'hits':>12}"
        f"{'demotions':>11}{'failed':>8}{'promotions':>12}{'evictions':>11}{'lost':>8}"
    )
    for t in tiers:
        print(
            f"{t.tier.name.lower():<6}{t.capacity:>16}{t.used:>16}{t.objects:>10}{t.hits:>12}"
            f"{t.demotions:>11}{t.demotions_failed:>8}{t.promotions:>12}{t.evictions:>11}"
            f"{t.lost:>8}"
        )
