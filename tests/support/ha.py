"""The elected master of an HA store cluster, as tests see it through etcd."""

from __future__ import annotations

from kvconnect._config import cluster_token
from kvconnect.errors import StoreError
from kvconnect.etcd import Etcd
from kvconnect.store import messages as m
from kvconnect.store.rpc import RpcClient, find_leader


def leader_of(url: str) -> str | None:
    """The endpoint etcd names as the leader (None: no leader now)."""
    etcd = Etcd(url)
    try:
        return find_leader(etcd)
    finally:
        etcd.close()


def leader_stats(url: str) -> m.StatsReply | None:
    """The leader's stats (None while no leader answers)."""
    rpc = RpcClient(url, 1.0, token=cluster_token(None, "", False))
    try:
        reply = rpc.call(m.Stats())
    except StoreError:
        return None
    finally:
        rpc.close()
    return reply if isinstance(reply, m.StatsReply) else None
