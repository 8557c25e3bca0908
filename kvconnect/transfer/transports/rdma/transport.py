"""RDMA transport: one-sided READ/WRITE over RC queue pairs (pyverbs), TCP as the fallback.

Per peer engine a *link* holds ``rdma_qps_per_peer`` RC queue pairs for every (local NIC, peer
NIC) pair ("paths", numbered by slot). Links are built on first use: the initiator creates its
QPs and sends their QPN/GID/PSN/MTU in an ``RdmaConnect`` control call on the peer's listener;
the peer creates its ends, brings them to RTS and answers with them and the (address, rkey)
of every region asked for. Keys of regions registered later are fetched the same way.

Threads: ``submit`` only queues. One *poster* thread connects links and posts work requests
(slices cut into ``rdma_slice_bytes`` pieces, spread round-robin over the paths of the NICs
nearest to the local memory). One *completion* thread per engine polls every NIC's CQ, spins
for a bounded number of empty polls, then sleeps on the completion channels.

Failures: a work completion with an error puts its QP in ERR (the rest of its work is flushed);
the QP is never reused: the next use of its slot builds a new one. A slice whose work failed is
retried on another path, up to ``max_retries`` times, then handed to the TCP transport (also at
once for a remote access error: TCP's listener then answers with the authoritative refusal).
A peer whose paths all failed is served over TCP for a few seconds before RDMA is tried again.

Settling: a slice is pinned while it has work requests posted. At its deadline the batch calls
the path's abort, which moves the QP to ERR; the slice is unpinned only when every one of its
work requests has completed (flushed), so no RDMA lands in memory of a request reported failed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from kvconnect.errors import (
    BrokenError,
    ClosedError,
    ConfigError,
    KVConnectError,
    PeerUnreachable,
    ProtocolError,
    RegistrationError,
)
from kvconnect.transfer.batch import Slice, complete_slices, pin_slices, unpin_slices
from kvconnect.transfer.config import TransferConfig
from kvconnect.transfer.memory import MemoryKind, MemoryRegion, MemoryRegistry
from kvconnect.transfer.protocol import wire
from kvconnect.transfer.segment import SegmentDescriptor
from kvconnect.transfer.stats import Counters, TransportStats
from kvconnect.transfer.transports.base import Transport, TransportContext, TransportEntry
from kvconnect.transfer.transports.rdma import topology, verbs
from kvconnect.transfer.transports.rdma.plan import chunks, connect_steps
from kvconnect.transfer.transports.rdma.state import Link, Path, Registrations, Work
from kvconnect.transfer.types import Capabilities, TransferOp

log = logging.getLogger(__name__)

_MAX_WR: Final = 256  # work requests outstanding per QP
_POLL_BATCH: Final = 32
_SPIN: Final = 50e-6  # seconds of empty polls before sleeping on the completion channels
_WAIT: Final = 0.05  # longest sleep on a channel: close() is noticed within it
_DEGRADED: Final = 5.0  # seconds a peer whose RDMA paths all failed is served over TCP
_CLOSE_DRAIN: Final = 5.0  # longest wait at close for flushed completions
_RELEASE_TIMEOUT: Final = 1.0  # per peer, at close: telling it to drop our QPs


def available(config: TransferConfig) -> list[str]:
    """The RDMA devices this engine may use (allow-list applied); [] without RDMA."""
    allowed = {name.strip() for name in config.rdma_nics.split(",") if name.strip()}
    present = verbs.device_names()
    missing = allowed - set(present)
    if missing:
        raise ConfigError(f"rdma_nics names unknown devices {sorted(missing)}; present: {present}")
    return [name for name in present if not allowed or name in allowed]


class RdmaTransport:
    """Moves slices with RDMA READ/WRITE; also answers peers' connect requests."""

    name = "rdma"
    capabilities = Capabilities(
        endpoint="rdma", endpoint_label="RDMA NIC", both_ends=True, memory_only=True
    )

    def __init__(
        self,
        config: TransferConfig,
        registry: MemoryRegistry,
        engine_id: str,
        fallback: Transport,
        on_lost: Callable[[SegmentDescriptor], None],
        nic_names: Sequence[str],
    ) -> None:
        """Open ``nic_names`` (from :func:`available`); threads start in :meth:`start`."""
        self.config = config
        self._registry = registry
        self._engine_id = engine_id
        self._fallback = fallback
        self._on_lost = on_lost
        self.counters = Counters(TransportStats)
        self._nics: dict[str, verbs.Nic] = {}
        unusable = []
        for name in nic_names:
            try:
                self._nics[name] = verbs.Nic(name, config.rdma_gid_index)
            except (BrokenError, *verbs.verbs_errors()) as exc:  # type: ignore[misc]
                unusable.append(f"{name}: {exc}")
        if not self._nics:
            raise BrokenError(f"no RDMA device is usable ({'; '.join(unusable)})")
        for reason in unusable:
            log.warning("RDMA device not used: %s", reason)
        sysfs = {d.name: d for d in topology.discover_nics()}
        self._places = [sysfs.get(n, topology.Device(n, (), -1)) for n in self._nics]
        self._gpus = topology.discover_gpus()
        self._near_cache: dict[int, set[str]] = {}  # CUDA device (-1: host) → nearest NICs
        self._memory = Registrations(registry.owns)
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._inflight: dict[int, Work] = {}
        self._wr_ids = itertools.count(1)
        self._links: dict[str, Link] = {}
        self._served: dict[tuple[str, int], Path] = {}
        self._queue: queue.SimpleQueue[tuple[SegmentDescriptor, list[Work]] | None] = (
            queue.SimpleQueue()
        )
        self._forget_requests: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._closed = False
        self._stop_polling = False
        self._threads: list[threading.Thread] = []

    @property
    def nic_names(self) -> list[str]:
        """Names of the NICs in use (published in the segment's ``rdma`` endpoint)."""
        return list(self._nics)

    def start(self) -> None:
        """Start the poster and completion threads."""
        for target, name in ((self._post_loop, "post"), (self._poll_loop, "poll")):
            thread = threading.Thread(target=target, name=f"kvconnect-rdma-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    # --------------------------------------------------------------------------- Transport

    def submit(self, peer: SegmentDescriptor, op: TransferOp, slices: Sequence[Slice]) -> None:
        works = [Work(peer, op, piece) for piece in slices]
        if self._closed:
            complete_slices(slices, ClosedError("engine closed"))
            return
        self._queue.put((peer, works))

    def forget(self, engine_id: str) -> None:
        self._forget_requests.put(engine_id)  # the poster owns the links: it drops this one
        self._queue.put(None)

    def stats(self) -> TransportStats:
        peers = len(self._links)  # owned by the poster thread: a racy but harmless read
        return dataclasses.replace(self.counters.snapshot(), peers=peers)

    def close(self) -> None:
        """Fail queued work, flush posted work, stop threads, destroy QPs, MRs and NICs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._space.notify_all()
        self._queue.put(None)
        for thread in self._threads[:1]:  # the poster: no new work after it ends
            thread.join(timeout=_CLOSE_DRAIN)
        self._drain_queue()  # work a racing submit queued after the poster's last look
        for link in list(self._links.values()):
            self._say_goodbye(link.peer)
        for link in list(self._links.values()):
            for path in link.paths.values():
                path.abort()
        for path in list(self._served.values()):
            path.abort()
        for thread in self._threads[1:]:  # the poller drains the flushed completions
            thread.join(timeout=_CLOSE_DRAIN)
            self._stop_polling = True  # flushes that never came must not keep it alive
            thread.join(timeout=_CLOSE_DRAIN)
        for link in self._links.values():
            for path in link.paths.values():
                path.close()
        for path in self._served.values():
            path.close()
        self._memory.close()
        self._close_nics()
        self._registry.on_withdraw = None

    def _say_goodbye(self, peer: SegmentDescriptor) -> None:
        """Let the peer drop its ends of our QPs now (best effort: a peer that does not answer
        keeps them until it closes, as for an initiator that died)."""
        try:
            self._call(peer, [], [], release=True)
        except (KVConnectError, OSError) as exc:
            log.debug("RDMA release at %s failed: %s", peer.name, exc)

    def withdraw(self, region: MemoryRegion) -> None:
        """``region`` was unregistered or fenced: its MRs (and keys peers hold) die now."""
        self._memory.withdraw(region.id)

    # -------------------------------------------------------------------------- responder

    def accept(self, request: wire.RdmaConnect) -> wire.ControlReply:
        """Answer a peer's connect: build our ends of its paths and look up region keys.

        Runs on a listener thread. Unknown regions are left out of the reply.
        """
        if request.version != wire.RDMA_VERSION:
            return wire.ErrorReply(wire.Status.BAD_REQUEST, f"RDMA version {request.version}")
        if self._closed:
            return wire.ErrorReply(wire.Status.INTERNAL, "engine closing")
        if request.release:
            self._release(request.engine_id)
            return wire.RdmaAccept([], [])
        try:
            paths = [self._serve_path(request.engine_id, remote) for remote in request.paths]
            keys = self._keys(request.regions)
        except (KVConnectError, *verbs.verbs_errors()) as exc:  # type: ignore[misc]
            log.warning("refused an RDMA connect from %s: %s", request.engine_id[:12], exc)
            return wire.ErrorReply(wire.Status.INTERNAL, str(exc))
        return wire.RdmaAccept(paths, keys)

    def _serve_path(self, engine_id: str, remote: wire.RdmaPath) -> wire.RdmaPath:
        nic = self._nics.get(remote.peer_nic)
        if nic is None:
            raise BrokenError(f"no NIC {remote.peer_nic} here")
        qp = nic.create_qp(1, 0)  # responder only: it never posts
        path = Path(remote.slot, nic, remote.nic, qp)
        local = nic.endpoint(qp, remote.slot, remote.nic)
        try:
            path.driver.connect(self._steps(nic, local, remote))
        except BaseException:
            path.close()
            raise
        with self._lock:
            old = self._served.pop((engine_id, remote.slot), None)
            self._served[(engine_id, remote.slot)] = path
        if old is not None:  # the initiator rebuilt this slot: its old QP is dead
            old.close()
        return local

    def _release(self, engine_id: str) -> None:
        with self._lock:
            gone = [key for key in self._served if key[0] == engine_id]
            paths = [self._served.pop(key) for key in gone]
        for path in paths:
            path.close()

    def _keys(self, region_ids: Sequence[int]) -> list[wire.RdmaKey]:
        keys = []
        for region_id in region_ids:
            region = self._registry.get(region_id)
            if region is None or region.kind is MemoryKind.FILE:  # no memory to register
                continue
            try:
                mrs = [(nic.name, self._memory.mr(region, nic)) for nic in self._nics.values()]
            except RegistrationError as exc:  # the initiator then reaches it over TCP
                log.debug("no RDMA keys for region %d: %s", region_id, exc)
                continue
            keys += [wire.RdmaKey(region_id, nic, r.base, int(r.mr.rkey)) for nic, r in mrs]
        return keys

    def _steps(self, nic: verbs.Nic, local: wire.RdmaPath, remote: wire.RdmaPath) -> list[Any]:
        return connect_steps(
            local,
            remote,
            port=verbs.PORT,
            gid_index=nic.gid_index,
            access=verbs.full_access(),
            rd_atomic=nic.rd_atomic,
        )

    # ----------------------------------------------------------------------------- poster

    def _post_loop(self) -> None:
        while True:
            job = self._queue.get()
            while not self._forget_requests.empty():
                self._drop_link(self._forget_requests.get(), BrokenError("segment withdrawn"))
            if job is None:
                if self._closed:
                    self._drain_queue()
                    return
                continue
            peer, works = job
            try:
                self._post_works(peer, works)
            except Exception as exc:  # a bug must fail this work, not kill the thread
                log.exception("RDMA poster failed")
                self._fail_works(works, BrokenError(f"RDMA poster failed: {exc}"))

    def _drain_queue(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._fail_works(job[1], ClosedError("engine closed"))

    def _post_works(self, peer: SegmentDescriptor, works: list[Work]) -> None:
        try:
            link = self._link(peer)
            if time.monotonic() < link.degraded_until:
                self._to_tcp(works)
                return
            self._ensure_keys(link, {w.slice.remote_region for w in works})
        except PeerUnreachable as exc:
            self._drop_link(peer.engine_id, exc)
            self._on_lost(peer)
            self._fail_works(works, exc)
            return
        except KVConnectError as exc:  # the peer cannot do RDMA with us: TCP can
            log.warning("RDMA to %s unavailable, using TCP: %s", peer.name, exc)
            self._to_tcp(works)
            return
        groups: dict[int, tuple[Path, list[Work]]] = {}
        for work in works:
            path = self._choose(link, work)
            if path is None:
                continue
            if link.key(work.slice.remote_region, path.peer_nic) is None:
                self._to_tcp([work])  # the peer no longer has the region: TCP says so
                continue
            groups.setdefault(id(path), (path, []))[1].append(work)
        for path, group in groups.values():
            pinned = {id(s) for s in pin_slices([w.slice for w in group], path.abort)}
            for work in group:
                if id(work.slice) in pinned:  # else its request already ended
                    self._post_one(link, path, work)

    def _link(self, peer: SegmentDescriptor) -> Link:
        link = self._links.get(peer.engine_id)
        if link is None:
            link = Link(peer)
            self._connect(link, range(self._slot_count(peer)))
            self._links[peer.engine_id] = link
        return link

    def _slot_count(self, peer: SegmentDescriptor) -> int:
        return len(self._nics) * len(_peer_nics(peer)) * self.config.rdma_qps_per_peer

    def _pair(self, peer: SegmentDescriptor, slot: int) -> tuple[verbs.Nic, str]:
        """Slot → (local NIC, peer NIC): every pair gets ``rdma_qps_per_peer`` slots."""
        peer_nics = _peer_nics(peer)
        pair = slot % (len(self._nics) * len(peer_nics))
        local = list(self._nics.values())[pair // len(peer_nics)]
        return local, peer_nics[pair % len(peer_nics)]

    def _connect(self, link: Link, slots: Sequence[int], regions: Sequence[int] = ()) -> None:
        """Build new QPs for ``slots`` and connect them through the peer's listener."""
        fresh: dict[int, tuple[Path, wire.RdmaPath]] = {}
        try:
            for slot in slots:
                nic, peer_nic = self._pair(link.peer, slot)
                qp = nic.create_qp(_MAX_WR, self.config.rdma_inline_bytes)
                path = Path(slot, nic, peer_nic, qp)
                fresh[slot] = (path, nic.endpoint(qp, slot, peer_nic))
            reply = self._call(link.peer, [ep for _, ep in fresh.values()], regions)
            for remote in reply.paths:
                path, local = fresh[remote.slot]
                path.driver.connect(self._steps(path.nic, local, remote))
        except BaseException:
            for path, _ in fresh.values():
                path.close()
            raise
        for slot, (path, _) in fresh.items():
            old = link.paths.get(slot)
            link.paths[slot] = path
            if old is not None:
                self._retire(old)
        link.store(reply.keys)

    def _ensure_keys(self, link: Link, region_ids: set[int]) -> None:
        missing = link.missing(region_ids)
        if missing:
            link.store(self._call(link.peer, [], missing).keys)

    def _call(
        self,
        peer: SegmentDescriptor,
        paths: list[wire.RdmaPath],
        regions: Sequence[int],
        *,
        release: bool = False,
    ) -> wire.RdmaAccept:
        endpoint = peer.endpoints.get("tcp")
        if endpoint is None:
            raise PeerUnreachable(f"segment {peer.name} has no TCP endpoint")
        request = wire.RdmaConnect(
            wire.RDMA_VERSION, self._engine_id, paths, list(regions), release
        )
        timeout = self.config.connect_timeout
        if release:
            timeout = min(timeout, _RELEASE_TIMEOUT)
        deadline = wire.deadline_after(timeout)  # one bound for connect, handshake and reply
        sock, engine_id = wire.open_connection(endpoint, self.config.token, timeout)
        try:
            if engine_id.hex() != peer.engine_id:
                raise PeerUnreachable(f"segment {peer.name} restarted")
            try:
                reply, _fds = wire.control_call(sock, request, deadline)
            except OSError as exc:
                raise PeerUnreachable(f"RDMA connect to {peer.name} failed: {exc}") from exc
        finally:
            sock.close()
        if isinstance(reply, wire.ErrorReply):
            raise BrokenError(f"{peer.name} refused the RDMA connect: {reply.message}")
        if not isinstance(reply, wire.RdmaAccept):
            raise ProtocolError(f"unexpected reply to an RDMA connect: {type(reply).__name__}")
        return reply

    def _post_one(self, link: Link, path: Path, work: Work) -> None:
        """Post the work requests of one pinned slice on ``path``."""
        region = work.slice.local
        key = link.key(work.slice.remote_region, path.peer_nic)
        if key is None:  # dropped since the caller looked (a remote access error just now)
            unpin_slices([work.slice], path.abort)
            self._to_tcp([work])
            return
        try:
            registered = self._memory.mr(region, path.nic)
        except KVConnectError as exc:
            unpin_slices([work.slice], path.abort)
            self._fail_works([work], exc)
            return
        pieces = chunks(work.slice.local_offset, work.slice.length, self.config.rdma_slice_bytes)
        delta = work.slice.remote_offset - work.slice.local_offset
        write = work.op is TransferOp.WRITE
        code = verbs.opcode(write)
        lkey = int(registered.mr.lkey)
        with self._lock:
            work.path, work.left, work.status = path, len(pieces), 0
        for n, (offset, length) in enumerate(pieces):
            wr_id = next(self._wr_ids)
            with self._lock:
                # A full send queue waits for completions; an aborted QP or close ends the
                # wait and the post below fails, which retries the slice elsewhere.
                while path.outstanding >= _MAX_WR and path.driver.usable and not self._closed:
                    self._space.wait(_WAIT)
                self._inflight[wr_id] = work
                path.outstanding += 1
            try:
                inline = write and length <= self.config.rdma_inline_bytes
                local = (registered.base + offset, length, lkey)
                remote = (key[1], key[0] + offset + delta)
                path.nic.post(path.qp, wr_id, code, local, remote, inline)
            except verbs.verbs_errors() as exc:
                log.debug("post to %s slot %d failed: %s", link.peer.name, path.slot, exc)
                self._unpost(work, wr_id, len(pieces) - n)
                path.abort()
                return

    def _choose(self, link: Link, work: Work) -> Path | None:
        """A usable path near the local memory that has not failed this slice, rebuilding
        broken QPs if needed; None if the slice went elsewhere (TCP or failed)."""
        for rebuilt in (False, True):
            near = self._near(work.slice.local)
            usable = [
                s for s, p in link.paths.items() if p.driver.usable and id(p) not in work.tried
            ]
            preferred = [s for s in usable if link.paths[s].nic.name in near] or usable
            slot = link.spreader.pick(preferred)
            if slot is not None:
                return link.paths[slot]
            if rebuilt:
                break
            broken = [s for s, p in link.paths.items() if not p.driver.usable]
            if not broken:
                break
            try:
                self._connect(link, broken)
            except PeerUnreachable as exc:
                self._drop_link(link.peer.engine_id, exc)
                self._fail_works([work], exc)
                return None
            except (KVConnectError, *verbs.verbs_errors()) as exc:  # type: ignore[misc]
                log.warning("cannot rebuild RDMA paths to %s: %s", link.peer.name, exc)
                break
        self._degrade(link)
        self._to_tcp([work])
        return None

    def _near(self, region: MemoryRegion) -> set[str]:
        """Names of the NICs nearest ``region``'s memory (cached per device)."""
        device = region.device if region.kind is MemoryKind.CUDA else -1
        near = self._near_cache.get(device)
        if near is None:
            gpu = self._gpus[device] if 0 <= device < len(self._gpus) else None
            near = {d.name for d in topology.nearest_tier(self._places, gpu)}
            self._near_cache[device] = near
        return near

    def _unpost(self, work: Work, wr_id: int, unposted: int) -> None:
        """``wr_id`` and the ``unposted - 1`` after it never reached the QP."""
        with self._lock:
            del self._inflight[wr_id]
            if work.path is not None:
                work.path.outstanding -= 1
            work.left -= unposted
            work.status = work.status or -1
            finished = work.left == 0
        if finished:
            self._finish([work])

    # ------------------------------------------------------------------------- completions

    def _poll_loop(self) -> None:
        nics = list(self._nics.values())
        # Spinning catches back-to-back completions without a wake-up; bounded in time because
        # a spinning thread takes CPU from the rest of the host (and from rxe, in the kernel).
        last = time.perf_counter()
        while True:
            if self._poll_once(nics):
                last = time.perf_counter()
                continue
            if self._stop_polling or (self._closed and not self._inflight):
                return
            if time.perf_counter() - last < _SPIN:
                continue
            for nic in nics:
                nic.arm()
            if self._poll_once(nics):  # completions that raced with arming
                last = time.perf_counter()
                continue
            for nic in verbs.wait_events(nics, _WAIT):
                nic.take_event()

    def _poll_once(self, nics: list[verbs.Nic]) -> bool:
        got = False
        for nic in nics:
            wcs = nic.poll(_POLL_BATCH)
            if wcs:
                got = True
                self._complete(wcs)
        return got

    def _complete(self, wcs: list[Any]) -> None:
        finished: list[Work] = []
        failed_paths: list[Path] = []
        with self._lock:
            for wc in wcs:
                work = self._inflight.pop(wc.wr_id, None)
                if work is None or work.path is None:
                    continue
                work.path.outstanding -= 1
                work.left -= 1
                if wc.status != verbs.WC_SUCCESS:
                    if work.status in (0, verbs.WC_FLUSH):
                        work.status = int(wc.status)
                    failed_paths.append(work.path)
                if work.left == 0:
                    finished.append(work)
            self._space.notify_all()
        for path in failed_paths:
            path.abort()  # already in ERR in hardware; mark it so nothing new is posted
        if finished:
            self._finish(finished)

    def _finish(self, works: list[Work]) -> None:
        """Works whose every work request completed: settle, complete or retry them.

        Batched (one lock per path to unpin, one to complete) because this is the hot path of
        small transfers."""
        by_path: dict[int, tuple[Path, list[Slice]]] = {}
        for work in works:
            assert work.path is not None
            by_path.setdefault(id(work.path), (work.path, []))[1].append(work.slice)
        for path, slices in by_path.values():
            unpin_slices(slices, path.abort)
            if path.retired and path.outstanding == 0:
                path.close()
        done = [w for w in works if w.status == 0]
        if done:
            complete_slices([w.slice for w in done])
            read = sum(w.slice.length for w in done if w.op is TransferOp.READ)
            written = sum(w.slice.length for w in done if w.op is TransferOp.WRITE)
            self.counters.add(ops=len(done), bytes_read=read, bytes_written=written)
        for work in works:
            if work.status != 0:
                self._retry(work)

    def _retry(self, work: Work) -> None:
        path = work.path
        assert path is not None
        reason = "post failed" if work.status < 0 else verbs.wc_status_name(work.status)
        log.debug("RDMA slice to %s failed (%s)", work.peer.name, reason)
        work.tried.add(id(path))
        work.attempts += 1
        self.counters.add(retries=1)
        if self._closed:
            self._fail_works([work], ClosedError("engine closed"))
        elif work.status == verbs.WC_REM_ACCESS:
            link = self._links.get(work.peer.engine_id)
            if link is not None:
                link.drop(work.slice.remote_region)
            self._to_tcp([work])  # the key died (region withdrawn): TCP says why
        elif work.attempts > self.config.max_retries:
            self._to_tcp([work])
        else:
            self._queue.put((work.peer, [work]))

    # ---------------------------------------------------------------------------- helpers

    def _to_tcp(self, works: list[Work]) -> None:
        if not works:
            return
        self.counters.add(errors=len(works))
        by_op: dict[TransferOp, list[Slice]] = {}
        for work in works:
            by_op.setdefault(work.op, []).append(work.slice)
        for op, slices in by_op.items():
            self._fallback.submit(works[0].peer, op, slices)

    def _fail_works(self, works: list[Work], error: KVConnectError) -> None:
        self.counters.add(errors=len(works))
        complete_slices([w.slice for w in works], error)

    def _degrade(self, link: Link) -> None:
        if time.monotonic() >= link.degraded_until:
            log.warning("RDMA paths to %s failed; using TCP for %.0f s", link.peer.name, _DEGRADED)
        link.degraded_until = time.monotonic() + _DEGRADED

    def _retire(self, path: Path) -> None:
        path.abort()
        with self._lock:
            path.retired = True
            idle = path.outstanding == 0
        if idle:
            path.close()

    def _drop_link(self, engine_id: str, error: KVConnectError) -> None:
        link = self._links.pop(engine_id, None)
        if link is None:
            return
        log.debug("dropping RDMA link to %s: %s", link.peer.name, error)
        for path in link.paths.values():
            self._retire(path)

    def _close_nics(self) -> None:
        for nic in self._nics.values():
            nic.close()


def _peer_nics(peer: SegmentDescriptor) -> list[str]:
    names = [n for n in peer.endpoints.get("rdma", "").split(",") if n]
    if not names:
        raise BrokenError(f"segment {peer.name} offers no RDMA endpoint")
    return names


def _build(context: TransportContext) -> RdmaTransport | None:
    """The RDMA transport, when this host has RDMA (``auto``) or it is forced (``rdma``)."""
    config = context.config
    if config.transport not in ("auto", "rdma"):
        return None
    nics = available(config)
    if not nics:
        if config.transport == "rdma":
            raise ConfigError("transport 'rdma' is forced but no RDMA device is usable")
        return None
    try:
        rdma = RdmaTransport(
            config,
            context.registry,
            context.engine_id,
            context.built["tcp"],
            context.on_lost,
            nics,
        )
    except BrokenError as exc:  # e.g. every port down: auto runs on without RDMA
        if config.transport == "rdma":
            raise ConfigError(f"transport 'rdma' is forced but {exc}") from exc
        log.warning("continuing without RDMA: %s", exc)
        return None
    context.registry.on_withdraw = rdma.withdraw
    rdma.start()
    return rdma


ENTRY = TransportEntry(RdmaTransport.name, _build)
