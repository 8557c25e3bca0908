"""What the HiCache backend reports: SGLang's storage samples and kvconnect's Prometheus series.

Both exist only with SGLang's ``--enable-metrics`` (``storage_config.enable_storage_metrics``):
without it every method returns at once and no series is created.

* **SGLang's** ``StorageMetrics`` (what ``get_stats`` hands SGLang's collector, which feeds its
  ``sglang:prefetch_pgs``/``backup_pgs`` and ``…_bandwidth`` histograms): per read or write
  batch, the pages moved and the wire bandwidth in GiB/s (bytes / 2**30 over the call's wall
  time), as SGLang's mooncake and hf3fs backends compute it. A write's sample leaves out pages
  the store already held, and a write that moved nothing gives no sample, as SGLang documents
  its backup bandwidth.
* **kvconnect's** series, ``kvconnect_hicache_*``, registered once per process in
  prometheus_client's default registry. SGLang starts its scheduler processes (where the
  backend runs) with ``PROMETHEUS_MULTIPROC_DIR`` set, so prometheus_client writes these values
  to that directory and SGLang's HTTP server serves them on its ``/metrics`` with its own. Every
  series carries its rank (``tp_rank``, ``pp_rank``, ``dp_rank``, ``attn_cp_rank``, as SGLang's
  storage series): the multiprocess collector sums equal series of different processes.

Called from SGLang's scheduler, prefetch and backup threads; thread-safe; never raises.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvconnect.store.federation import PeerStatus
from kvconnect.store.messages import Code
from kvconnect.store.resilience import BreakerState

GIB = 1 << 30  # SGLang's storage bandwidths are GiB/s ("GB" in its docs)
MAX_SAMPLES = 10_000  # per list, between two collections (SGLang collects every scheduler step)
RANK_LABELS = ("tp_rank", "pp_rank", "dp_rank", "attn_cp_rank")
_BATCH_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
_EXPIRED = (Code.TIMEOUT, Code.UNSETTLED)  # the read's deadline ended these transfers


@dataclass(frozen=True, slots=True)
class _Families:
    """The process's ``kvconnect_hicache_*`` metrics (one set: prometheus_client refuses a
    name twice in a registry)."""

    pages_hit: Counter
    pages_missed: Counter
    partial_reads: Counter
    partial_read_pages: Counter
    pages_written: Counter
    pages_skipped: Counter
    pages_write_failed: Counter
    read_bytes: Counter
    written_bytes: Counter
    batch_seconds: Histogram
    deadline_expiries: Counter
    canceled_reads: Counter
    pages_withheld: Counter
    errors: Counter
    breaker_state: Gauge
    peer_up: Gauge
    peer_keys: Counter


_families_lock = threading.Lock()


def _shared_families() -> _Families:
    """Created on first use (under a lock: backends of one process share them)."""
    with _families_lock:
        return _create_families()


@functools.cache
def _create_families() -> _Families:
    ranks = RANK_LABELS

    def counter(name: str, documentation: str) -> Counter:
        return Counter(f"kvconnect_hicache_{name}", documentation, ranks)

    return _Families(
        pages_hit=counter("pages_hit", "Pages read whole from the store into the host pool"),
        pages_missed=counter(
            "pages_missed", "Pages SGLang asked to read that did not arrive (absent, late, failed)"
        ),
        partial_reads=counter(
            "partial_reads",
            "Read batches SGLang reuses only in part: their leading run of arrived pages is "
            "shorter than the batch, and not empty",
        ),
        partial_read_pages=counter(
            "partial_read_pages", "Pages of that leading run of partial read batches"
        ),
        pages_written=counter("pages_written", "Pages written to the store"),
        pages_skipped=counter("pages_skipped", "Pages SGLang backed up that were already stored"),
        pages_write_failed=counter("pages_write_failed", "Pages SGLang backed up and not stored"),
        read_bytes=counter("read_bytes", "Bytes read from the store into the host pool"),
        written_bytes=counter("written_bytes", "Bytes written from the host pool to the store"),
        batch_seconds=Histogram(
            "kvconnect_hicache_batch_seconds",
            "Time of one SGLang storage call (up to 128 pages), by operation",
            [*ranks, "op"],
            buckets=_BATCH_BUCKETS,
        ),
        deadline_expiries=counter(
            "deadline_expiries", "Read batches ended by their deadline with pages still in transfer"
        ),
        canceled_reads=counter(
            "canceled_reads",
            "Read batches stopped because SGLang terminated their prefetch (its verdict, "
            "best_effort admission, an aborted request)",
        ),
        pages_withheld=counter(
            "pages_withheld",
            "Pages whose host slots were kept from SGLang until their unstoppable transfer ended",
        ),
        errors=Counter(
            "kvconnect_hicache_errors",
            "Unexpected errors turned into misses or failed writes, by SGLang call",
            [*ranks, "call"],
        ),
        breaker_state=Gauge(
            "kvconnect_hicache_breaker_state",
            "The store client's circuit breaker: 1 for its current state (open: local-only)",
            [*ranks, "state"],
            multiprocess_mode="mostrecent",
        ),
        peer_up=Gauge(
            "kvconnect_hicache_peer_up",
            "A peer cluster's breaker is closed (1: asked about misses; 0: skipped until a "
            "probe finds it back)",
            [*ranks, "peer"],
            multiprocess_mode="mostrecent",
        ),
        peer_keys=Counter(
            "kvconnect_hicache_peer_keys",
            "Keys per peer cluster by outcome: asked (home lacked them), hit (read from it), "
            "skipped (it was down), copied (home)",
            [*ranks, "peer", "outcome"],
        ),
    )


class BackendMetrics:
    """One backend's metrics (``KVConnectStore``); see the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig) -> None:
        self.enabled = bool(storage_config.enable_storage_metrics)
        self._lock = threading.Lock()  # guards the samples
        self._samples = StorageMetrics()
        self._families = _shared_families() if self.enabled else None
        self._ranks = _rank_labels(storage_config)
        self._peer_counts: dict[str, dict[str, int]] = {}  # guarded by _lock

    def read(
        self, pages: Sequence[bool], codes: Sequence[Code], moved: int, seconds: float
    ) -> None:
        """One ``batch_get_v1``: per page whether it arrived, per object its code, the bytes
        it moved (:func:`moved_bytes`) and its wall time."""
        families = self._families
        if families is None:
            return
        hit = sum(pages)
        leading = _leading(pages)
        self._sample(False, hit, moved, seconds)
        labels = self._ranks
        families.pages_hit.labels(**labels).inc(hit)
        families.pages_missed.labels(**labels).inc(len(pages) - hit)
        if 0 < leading < len(pages):
            families.partial_reads.labels(**labels).inc()
            families.partial_read_pages.labels(**labels).inc(leading)
        if any(code in _EXPIRED for code in codes):
            families.deadline_expiries.labels(**labels).inc()
        if Code.CANCELED in codes:
            families.canceled_reads.labels(**labels).inc()
        families.read_bytes.labels(**labels).inc(moved)
        families.batch_seconds.labels(**labels, op="read").observe(seconds)

    def write(
        self, pages: Sequence[bool], codes: Sequence[Code], moved: int, seconds: float
    ) -> None:
        """One ``batch_set_v1``: per page whether it is stored, per object its code (EXISTS:
        already stored, nothing moved), the bytes it moved and its wall time."""
        families = self._families
        if families is None:
            return
        objects = len(codes) // max(len(pages), 1)
        skipped = sum(
            stored and all(code is Code.EXISTS for code in codes[i * objects : (i + 1) * objects])
            for i, stored in enumerate(pages)
        )
        written = sum(pages) - skipped
        if written:
            self._sample(True, written, moved, seconds)
        labels = self._ranks
        families.pages_written.labels(**labels).inc(written)
        families.pages_skipped.labels(**labels).inc(skipped)
        families.pages_write_failed.labels(**labels).inc(len(pages) - sum(pages))
        families.written_bytes.labels(**labels).inc(moved)
        families.batch_seconds.labels(**labels, op="write").observe(seconds)

    def exists(self, seconds: float) -> None:
        """One ``batch_exists``."""
        if self._families is not None:
            self._families.batch_seconds.labels(**self._ranks, op="exists").observe(seconds)

    def withheld(self, pages: int) -> None:
        """Pages whose host slots wait for their transfer to settle."""
        if self._families is not None:
            self._families.pages_withheld.labels(**self._ranks).inc(pages)

    def error(self, call: str) -> None:
        """An unexpected exception in SGLang's ``call``, turned into a miss."""
        if self._families is not None:
            self._families.errors.labels(**self._ranks, call=call).inc()

    def breaker(self, state: BreakerState) -> None:
        """The breaker's state after a call (1 for it, 0 for the others)."""
        if self._families is None:
            return
        for each in BreakerState:
            self._families.breaker_state.labels(**self._ranks, state=each).set(each is state)

    def peers(self, statuses: Sequence[PeerStatus]) -> None:
        """The peer clusters after a call (their counters grew by what they grew since the
        last call)."""
        families = self._families
        if families is None:
            return
        for peer in statuses:
            families.peer_up.labels(**self._ranks, peer=peer.name).set(
                peer.breaker is BreakerState.CLOSED
            )
            counts = peer.counts
            now = {"asked": counts.asked, "hit": counts.hits, "skipped": counts.skipped}
            now["copied"] = counts.copied
            with self._lock:
                before = self._peer_counts.get(peer.name, {})
                self._peer_counts[peer.name] = now
            for outcome, count in now.items():
                grown = count - before.get(outcome, 0)
                if grown > 0:
                    families.peer_keys.labels(**self._ranks, peer=peer.name, outcome=outcome).inc(
                        grown
                    )

    def take_storage_metrics(self) -> StorageMetrics:
        """SGLang's samples since the last call (``get_stats``), handed out once."""
        with self._lock:
            samples, self._samples = self._samples, StorageMetrics()
        return samples

    def _sample(self, write: bool, pages: int, moved: int, seconds: float) -> None:
        with self._lock:  # the lists of the samples not yet handed out
            samples = self._samples
            pgs = samples.backup_pgs if write else samples.prefetch_pgs
            bandwidth = samples.backup_bandwidth if write else samples.prefetch_bandwidth
            if len(pgs) < MAX_SAMPLES:  # a bound if SGLang stops collecting
                pgs.append(pages)
                bandwidth.append(moved / GIB / seconds if seconds > 0 else 0.0)


def _rank_labels(storage_config: HiCacheStorageConfig) -> Mapping[str, str]:
    """The rank labels of a backend's series (SGLang's storage series use the same keys)."""
    return {
        "tp_rank": str(storage_config.tp_rank),
        "pp_rank": str(storage_config.pp_rank),
        "dp_rank": str(storage_config.dp_rank),
        "attn_cp_rank": str(storage_config.attn_cp_rank),
    }


def moved_bytes(codes: Sequence[Code], sizes: Sequence[int]) -> int:
    """Bytes a call moved, from its per-object codes and sizes: the objects it transferred
    (not those already stored, absent or failed)."""
    return sum(size for code, size in zip(codes, sizes, strict=True) if code is Code.OK)


def _leading(pages: Sequence[bool]) -> int:
    for n, arrived in enumerate(pages):
        if not arrived:
            return n
    return len(pages)
