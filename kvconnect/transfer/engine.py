"""TransferEngine: registered memory, a published segment, and batched one-sided READ/WRITE.

Lifecycle: construct (no threads), ``register``/``allocate`` memory (before or after start),
``start()`` (listener, transports and metadata come up), ``submit`` batches, ``close()``.

Threads: ``submit`` never blocks on I/O: it validates, slices and queues; descriptor lookups of
unknown segments run on resolver threads; bytes move on transport threads. Every method is
thread-safe.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvconnect.errors import (
    AccessDenied,
    ClosedError,
    ConfigError,
    InvalidRequest,
    KVConnectError,
    PeerUnreachable,
)
from kvconnect.lifecycle import Lifecycle
from kvconnect.transfer.batch import BatchState, DeadlineWatch, Slice, TransferBatch, make_slices
from kvconnect.transfer.config import TransferConfig
from kvconnect.transfer.datapath.copying import Copier, CopyWorkers
from kvconnect.transfer.datapath.cuda import DeviceCopier, default_copier
from kvconnect.transfer.datapath.iov import DataPath, select_datapath
from kvconnect.transfer.datapath.staging import StagingPool
from kvconnect.transfer.memory import MemoryKind, MemoryRegion, MemoryRegistry
from kvconnect.transfer.metadata import EmbeddedMetadata, MetadataBackend, P2PMetadata
from kvconnect.transfer.metadata.directory import SegmentDirectory
from kvconnect.transfer.protocol.listener import Listener
from kvconnect.transfer.protocol.wire import ControlReply, ErrorReply, RdmaConnect, Status
from kvconnect.transfer.routing import choose_transport
from kvconnect.transfer.segment import (
    RegionInfo,
    SegmentDescriptor,
    host_identity,
    process_identity,
)
from kvconnect.transfer.source import FileSource
from kvconnect.transfer.stats import EngineStats, ListenerStats
from kvconnect.transfer.transports import local as local_registry
from kvconnect.transfer.transports import registry
from kvconnect.transfer.transports.base import Transport, TransportContext
from kvconnect.transfer.transports.rdma.transport import RdmaTransport
from kvconnect.transfer.types import Capabilities, TransferOp, TransferRequest

log = logging.getLogger(__name__)

_RESOLVER_THREADS = 4
_COPY_JOB_SLICES = 4  # slices per copy job: amortizes hand-off cost, keeps threads busy
_ETCD_TIMEOUT = 2.0  # seconds, the longest one etcd call of the metadata backend may take


class _State(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    STARTED = "started"
    CLOSED = "closed"


class TransferEngine(Lifecycle):
    """Moves bytes between registered memory of this engine and peers' segments."""

    def __init__(
        self,
        config: TransferConfig | None = None,
        *,
        metadata: MetadataBackend | None = None,
        device_copier: DeviceCopier | None = None,
    ) -> None:
        """Create an engine (no threads, no sockets until :meth:`start`).

        ``metadata`` overrides the backend chosen by ``config.metadata``; ``device_copier``
        overrides the CUDA runtime used for device memory (tests inject a host-memory one).
        ``config.token`` of :attr:`config` is the cluster token in use (resolved here).
        """
        config = config or TransferConfig()
        self.config = config = config.replace(token=config.cluster_token())
        if config.metadata == "p2p" and config.name is not None:
            raise ConfigError("with p2p metadata the segment name is the listener's host:port")
        self._metadata = metadata or _metadata_backend(config)
        self._engine_id = uuid.uuid4().bytes
        self._registry = MemoryRegistry()
        self._directory = SegmentDirectory(
            self._metadata, config.connect_timeout, self._peer_replaced
        )
        self._device_copier = device_copier
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified when _state changes
        self._state = _State.NEW
        self._start_error = ""  # why start() failed; a string: an exception would pin frames
        self._publish_lock = threading.Lock()  # one describe-and-publish at a time, in order
        self._published = False
        self._name = config.name or ""
        self._listener: Listener | None = None
        self._also: tuple[str, ...] = ()  # tokens accepted besides the cluster token
        self._transports: dict[str, Transport] = {}  # most preferred first
        self._capabilities: dict[str, Capabilities] = {}  # what routing chooses from
        self._rdma: RdmaTransport | None = None
        self._workers: CopyWorkers | None = None
        self._resolver: ThreadPoolExecutor | None = None
        self._watch = DeadlineWatch()
        self._staging: StagingPool | None = None
        self._identity: SegmentDescriptor | None = None

    # --------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Bind the listener, start transports and publish the segment. Idempotent.

        A call while another thread starts the engine waits for that start. If starting fails
        the engine is closed (everything started so far is released) and the error is raised;
        later calls raise ClosedError naming it.
        """
        with self._changed:
            self._changed.wait_for(lambda: self._state is not _State.STARTING)
            if self._state is _State.STARTED:
                return
            if self._state is _State.CLOSED:
                raise self._closed_error()
            self._state = _State.STARTING
        try:
            self._start()
        except BaseException as exc:
            with self._changed:
                self._state, self._start_error = _State.CLOSED, f"{type(exc).__name__}: {exc}"
                self._changed.notify_all()
            self._stop()
            self._registry.close()
            raise
        with self._changed:
            self._state = _State.STARTED
            self._changed.notify_all()
        log.info("transfer engine %s started (%s)", self._name, ", ".join(self._transports))

    def _start(self) -> None:
        cfg = self.config
        datapath = select_datapath(cfg.native)
        self._watch.start()
        self._listener = Listener(
            cfg,
            self._registry,
            self._describe,
            self._engine_id,
            datapath,
            self._staging_pool,
            self._rdma_accept,
            lambda: self._also,
        )
        self._listener.start()
        if not self._name:
            self._name = (
                f"engine-{self._engine_id.hex()[:12]}"
                if cfg.metadata == "embedded"
                else self._listener.endpoints["tcp"]
            )
        self._workers = CopyWorkers(cfg.copy_threads, cfg.slice_bytes * _COPY_JOB_SLICES)
        self._build_transports(datapath, self._workers)
        self._identity = self._describe()  # routing needs only its host and process identity
        self._resolver = ThreadPoolExecutor(_RESOLVER_THREADS, "kvconnect-resolve")
        local_registry.publish(self._engine_id.hex(), self._registry)
        self._metadata.start(self._directory.forget)
        with self._publish_lock:
            self._metadata.publish(self._describe())
            self._published = True

    def _build_transports(self, datapath: DataPath, workers: CopyWorkers) -> None:
        """Build the registry's transports, least preferred first (see ``registry.entries``)."""
        built: dict[str, Transport] = {}
        context = TransportContext(
            config=self.config,
            registry=self._registry,
            engine_id=self._engine_id.hex(),
            datapath=datapath,
            copier=Copier(datapath, self._device),
            workers=workers,
            staging=self._staging_pool,
            on_lost=self._peer_lost,
            built=built,
        )
        entries = registry.entries()
        for entry in reversed(entries):
            transport = entry.build(context)
            if transport is not None:
                built[entry.name] = self._transports[entry.name] = transport
        self._transports = {e.name: built[e.name] for e in entries if e.name in built}
        self._capabilities = {name: t.capabilities for name, t in self._transports.items()}
        rdma = built.get(RdmaTransport.name)
        self._rdma = rdma if isinstance(rdma, RdmaTransport) else None

    def _rdma_accept(self, request: RdmaConnect) -> ControlReply:
        rdma = self._rdma
        if rdma is None:
            return ErrorReply(Status.BAD_REQUEST, "this engine has no RDMA transport")
        return rdma.accept(request)

    def close(self) -> None:
        """Withdraw the segment, fail queued work with ClosedError, stop threads. Idempotent.

        Waits for a start() running in another thread to finish first. Memory that transport
        threads still touch is not freed here: requests keep their regions (and so the buffers)
        alive until they settle, and the batches report them PENDING until then.
        """
        with self._changed:
            self._changed.wait_for(lambda: self._state is not _State.STARTING)
            previous, self._state = self._state, _State.CLOSED
            self._changed.notify_all()
        if previous is _State.STARTED:
            self._stop()
        if previous is not _State.CLOSED:
            self._registry.close()  # memory registered before start() is released too
            log.info("transfer engine %s closed", self._name)

    def _stop(self) -> None:
        local_registry.withdraw(self._engine_id.hex())
        try:
            self._metadata.withdraw(self._name)
        finally:
            self._metadata.close()
        if self._listener is not None:
            self._listener.close()
        if self._resolver is not None:
            self._resolver.shutdown(wait=True)
        for transport in self._transports.values():
            transport.close()
        if self._workers is not None:
            self._workers.close()
        self._watch.close()

    def __del__(self) -> None:
        if getattr(self, "_state", _State.CLOSED) is _State.STARTED:
            warnings.warn(
                f"TransferEngine {self._name} was not closed", ResourceWarning, stacklevel=1
            )

    # ------------------------------------------------------------------------------ segment

    @property
    def name(self) -> str:
        """This engine's segment name (peers put it in their requests); set by start()."""
        return self._name

    @property
    def segment(self) -> SegmentDescriptor:
        """The descriptor peers see now."""
        self._require_started()
        return self._describe()

    def _describe(self) -> SegmentDescriptor:
        listener = self._listener
        endpoints = dict(listener.endpoints) if listener is not None else {}
        if self._rdma is not None:
            endpoints["rdma"] = ",".join(self._rdma.nic_names)
        return SegmentDescriptor(
            name=self._name,
            engine_id=self._engine_id.hex(),
            process_id=process_identity(),
            host_id=host_identity(),
            endpoints=endpoints,
            regions=tuple(
                RegionInfo(r.id, r.length, r.kind.value, r.writable, r.shareable)
                for r in self._registry.regions()
                if not r.private
            ),
        )

    # ------------------------------------------------------------------------------- memory

    def register(
        self, buffer: object, *, writable: bool | None = None, private: bool = False
    ) -> MemoryRegion:
        """Register memory for transfers and publish it in the segment.

        ``buffer``: any C-contiguous buffer-protocol object (numpy, bytearray, mmap), a torch
        CPU tensor, or CUDA memory exposing ``__cuda_array_interface__`` (torch, cupy). The
        region keeps ``buffer`` alive until unregistered. ``writable=False`` refuses remote
        WRITEs into it. ``private`` regions are only the local side of this engine's requests:
        not published (registering one costs no descriptor update, e.g. no etcd write) and
        refused to peers. Raises RegistrationError.
        """
        self._require_open()
        region = self._registry.register(buffer, writable=writable, private=private)
        if not private:
            self._republish()
        return region

    def allocate(
        self, nbytes: int, *, hugepages: bool = False, writable: bool = True
    ) -> MemoryRegion:
        """Allocate and register ``nbytes`` of pre-faulted shared memory (``region.view``).

        Same-host peers reach such regions through shared memory (one copy, no involvement of
        this engine); regions from :meth:`register` are reached over TCP from other processes.
        ``hugepages`` backs it with 2 MiB pages (RegistrationError if none are reserved).
        ``writable=False`` refuses remote WRITEs, and same-host peers get a read-only fd of
        memory sealed against new writable mappings (``region.view`` stays writable here).
        """
        self._require_open()
        region = self._registry.allocate(nbytes, hugepages=hugepages, writable=writable)
        self._republish()
        return region

    def register_source(self, source: FileSource, length: int) -> MemoryRegion:
        """Publish bytes ``[0, length)`` of ``source`` as a read-only FILE region.

        Peers READ it like memory: over TCP (the listener asks ``source`` for each frame's
        ranges before answering; a SourceUnavailable fails just that frame's requests) or, in
        this process, through the local transport; RDMA and shared memory never reach it.
        WRITEs to it are refused, it cannot be the ``local`` region of a request, and it is not
        shareable. ``fence``/``unregister``/``users`` work on it as on memory; while
        ``users`` is not 0 a read may be calling ``source``. Raises RegistrationError.
        """
        self._require_open()
        region = self._registry.register_source(source, length)
        self._republish()
        return region

    def accept_tokens(self, tokens: Sequence[str]) -> None:
        """Let peers that prove any of ``tokens`` in, besides the cluster token (a store
        server takes its cluster's tenants' tokens); replaces the previous set. Connections
        already in are not affected. Any thread."""
        self._also = tuple(token for token in tokens if token)

    def register_alias(self, region: MemoryRegion) -> MemoryRegion:
        """Register the memory of ``region``, a region of *another* engine, here as a private
        region (the local side of this engine's requests; never published): two engines
        that speak to different clusters (their own tokens) can then move bytes into and out
        of the same buffer. The alias keeps ``region`` (and its buffer) alive until it is
        unregistered; unregistering either leaves the other registered. Raises
        RegistrationError for a FILE region."""
        self._require_open()
        return self._registry.alias(region)

    def owns(self, region: MemoryRegion) -> bool:
        """Whether ``region`` is registered with this engine (and not unregistered since)."""
        return self._registry.owns(region)

    def unregister(self, region: MemoryRegion) -> None:
        """Withdraw ``region``. RegionBusy while transfers use it; peers are refused after."""
        self._registry.unregister(region)
        if not region.private:
            self._republish()

    def fence(self, region: MemoryRegion) -> MemoryRegion:
        """Cut off every peer that addressed ``region``: it is published again under a new id
        (same memory, same bytes) and requests naming the old id fail from now on — over TCP,
        and through shared memory for peers that mapped it. Returns the new region; the old
        one is no longer registered. Accesses that began before may still run until
        :meth:`users` of the old region is 0.

        A store server does this before it mounts its memory at a new master, which knows
        nothing of the transfers the old master started: none of them can land afterwards.
        """
        self._require_open()
        fresh = self._registry.fence(region)
        self._republish()
        return fresh

    def users(self, region: MemoryRegion) -> int:
        """How many transfers (served or initiated) use ``region`` now."""
        return self._registry.users(region)

    def _republish(self) -> None:
        # Serialized, so a slower publish never overwrites a newer descriptor; before start()
        # has published the first one there is nothing to update (it will include the change).
        with self._publish_lock:
            if self._published and self._state is not _State.CLOSED:
                self._metadata.publish(self._describe())

    # ---------------------------------------------------------------------------- transfers

    def submit(
        self,
        op: TransferOp,
        requests: Iterable[TransferRequest],
        *,
        timeout: float | None = None,
    ) -> TransferBatch:
        """Start a batch of READs or WRITEs; returns at once.

        Every request must use a region registered with this engine as ``local``; the batch
        holds it until the request settles. ``timeout`` (default ``request_timeout``) is the
        deadline of every request. Raises InvalidRequest for malformed requests (nothing is
        started then), ClosedError after close(). Remote refusals and failures are reported per
        request by the batch.
        """
        self._require_started()
        if not isinstance(op, TransferOp):
            raise InvalidRequest(f"op must be a TransferOp, got {op!r}")
        batch_requests = list(requests)
        held = self._hold_local(op, batch_requests)
        deadline = time.monotonic() + (self.config.request_timeout if timeout is None else timeout)
        batch = BatchState(
            op,
            batch_requests,
            deadline,
            self.config.slice_bytes,
            lambda: self._registry.release_many(held),
            settle_grace=self.config.settle_grace,
        )
        self._watch.add(batch)
        by_segment: dict[str, list[int]] = collections.defaultdict(list)
        for index, request in enumerate(batch_requests):
            by_segment[request.segment].append(index)
        for segment, indices in by_segment.items():
            descriptor = self._directory.cached(segment)
            if descriptor is not None:
                self._dispatch(descriptor, batch, indices, fresh=False)
            else:
                self._resolve_later(segment, batch, indices)
        return TransferBatch(batch)

    def transfer(
        self,
        op: TransferOp,
        requests: Iterable[TransferRequest],
        *,
        timeout: float | None = None,
    ) -> None:
        """Blocking :meth:`submit`: returns when all completed, else raises TransferError."""
        batch = self.submit(op, requests, timeout=timeout)
        batch.wait()
        batch.raise_for_status()

    def read(
        self,
        local: MemoryRegion,
        local_offset: int,
        segment: str,
        remote_region: int,
        remote_offset: int,
        length: int,
        *,
        timeout: float | None = None,
    ) -> None:
        """Blocking READ of one range into ``local``; raises TransferError on failure."""
        request = TransferRequest(
            local, local_offset, segment, remote_region, remote_offset, length
        )
        self.transfer(TransferOp.READ, [request], timeout=timeout)

    def write(
        self,
        local: MemoryRegion,
        local_offset: int,
        segment: str,
        remote_region: int,
        remote_offset: int,
        length: int,
        *,
        timeout: float | None = None,
    ) -> None:
        """Blocking WRITE of one range from ``local``; raises TransferError on failure."""
        request = TransferRequest(
            local, local_offset, segment, remote_region, remote_offset, length
        )
        self.transfer(TransferOp.WRITE, [request], timeout=timeout)

    def stats(self) -> EngineStats:
        """Counters per transport and of the listener."""
        listener = self._listener
        if listener is None:
            return EngineStats(transports={}, listener=ListenerStats())
        return EngineStats(
            transports={name: t.stats() for name, t in self._transports.items()},
            listener=listener.stats(),
            served_latency=listener.latency.snapshot(),
        )

    # ------------------------------------------------------------------------------ helpers

    def _hold_local(
        self, op: TransferOp, requests: Sequence[TransferRequest]
    ) -> list[MemoryRegion]:
        """Validate requests and hold each distinct local region once for the batch."""
        regions: dict[int, MemoryRegion] = {}
        for request in requests:
            _check_request(op, request)
            regions[id(request.local)] = request.local
        held = list(regions.values())
        stranger = self._registry.hold_many(held)
        if stranger is not None:
            raise InvalidRequest(f"local region {stranger.id} is not registered with this engine")
        return held

    def _resolve_later(self, segment: str, batch: BatchState, indices: list[int]) -> None:
        resolver = self._resolver
        try:
            if resolver is None or self._state is not _State.STARTED:
                raise RuntimeError("closed")
            resolver.submit(self._resolve_and_dispatch, segment, batch, indices)
        except RuntimeError:
            _fail(batch, indices, ClosedError("engine closed"))

    def _resolve_and_dispatch(self, segment: str, batch: BatchState, indices: list[int]) -> None:
        if self._state is not _State.STARTED:
            _fail(batch, indices, ClosedError("engine closed"))
            return
        try:
            descriptor = self._directory.resolve(segment)
        except KVConnectError as exc:
            _fail(batch, indices, exc)
            return
        except Exception as exc:  # any failure to look up is reported per request, not raised
            _fail(batch, indices, PeerUnreachable(f"cannot resolve segment {segment}: {exc}"))
            return
        self._dispatch(descriptor, batch, indices, fresh=True)

    def _dispatch(
        self, peer: SegmentDescriptor, batch: BatchState, indices: list[int], *, fresh: bool
    ) -> None:
        me = self._identity
        assert me is not None
        routes: dict[int, tuple[RegionInfo, str] | KVConnectError | None] = {}
        routed: dict[str, list[Slice]] = collections.defaultdict(list)
        unknown: list[int] = []
        for index in indices:
            request = batch.requests[index]
            if request.remote_region not in routes:
                routes[request.remote_region] = self._route(me, peer, request.remote_region)
            route = routes[request.remote_region]
            if route is None:
                unknown.append(index)
                continue
            try:
                if isinstance(route, KVConnectError):
                    raise route
                region, name = route
                _check_remote(batch.op, request, region)
            except KVConnectError as exc:
                batch.fail(index, exc)
                continue
            routed[name].extend(make_slices(batch, index, request, self.config.slice_bytes))
        if unknown and fresh:
            _fail(batch, unknown, AccessDenied(f"segment {peer.name} has no such region"))
        elif unknown:
            # Regions registered after we cached the descriptor: look again once.
            self._directory.forget(peer.name)
            self._resolve_later(peer.name, batch, unknown)
        for name, slices in routed.items():
            self._transports[name].submit(peer, batch.op, slices)

    def _route(
        self, me: SegmentDescriptor, peer: SegmentDescriptor, region_id: int
    ) -> tuple[RegionInfo, str] | KVConnectError | None:
        region = peer.region(region_id)
        if region is None:
            return None
        try:
            return region, choose_transport(
                self.config.transport, me, peer, region, self._capabilities
            )
        except KVConnectError as exc:
            return exc

    def peer_region(self, segment: str, region_id: int) -> RegionInfo | None:
        """Region ``region_id`` of peer ``segment`` as this engine last learned it (its cached
        descriptor), without I/O: None if the segment was not looked up yet or has no such
        region."""
        descriptor = self._directory.cached(segment)
        return None if descriptor is None else descriptor.region(region_id)

    def forget_segment(self, name: str) -> None:
        """Drop what this engine keeps for peer segment ``name``: its descriptor and the
        connections and mappings of the engine that served it. For a peer known to be gone
        (its owner replaced or retired it); work still in flight to it fails, and a later
        request to ``name`` looks it up afresh. Waits on no answer from the peer: calls to it
        are interrupted, and their threads joined."""
        old = self._directory.drop(name)
        if old is None:
            return
        for transport in self._transports.values():
            transport.forget(old.engine_id)

    def _peer_lost(self, peer: SegmentDescriptor) -> None:
        self._directory.forget(peer.name)

    def _peer_replaced(self, old: SegmentDescriptor) -> None:
        """A lookup found segment ``old.name`` served by another engine now (the peer restarted,
        or the name moved): drop every connection and mapping the old engine had."""
        log.info("segment %s now belongs to another engine: forgetting the old one", old.name)
        for transport in self._transports.values():
            transport.forget(old.engine_id)

    def _device(self) -> DeviceCopier:
        return self._device_copier or default_copier()

    def _staging_pool(self) -> StagingPool:
        with self._lock:
            if self._staging is None:
                self._staging = StagingPool(self._device(), self.config.slice_bytes)
            return self._staging

    def _require_open(self) -> None:
        if self._state is _State.CLOSED:
            raise self._closed_error()

    def _require_started(self) -> None:
        """Return once started; a start() in progress is waited for, up to connect_timeout
        (every step of starting is bounded by it). Raises ClosedError otherwise."""
        with self._changed:
            if self._state is _State.STARTING:
                self._changed.wait_for(
                    lambda: self._state is not _State.STARTING, self.config.connect_timeout
                )
            state = self._state
        if state is _State.STARTED:
            return
        if state is _State.CLOSED:
            raise self._closed_error()
        raise ClosedError("engine not started" if state is _State.NEW else "engine still starting")

    def _closed_error(self) -> ClosedError:
        if not self._start_error:
            return ClosedError("engine is closed")
        return ClosedError(f"engine is closed: start failed: {self._start_error}")


def _metadata_backend(config: TransferConfig) -> MetadataBackend:
    """The backend ``config.metadata`` names (validated by TransferConfig)."""
    if config.metadata == "p2p":
        return P2PMetadata(config.token)
    if config.metadata == "embedded":
        return EmbeddedMetadata()
    # Imported here: the etcd client (grpc) loads only for engines that use etcd.
    from kvconnect.transfer.metadata.etcd import EtcdMetadata

    # etcd answers in milliseconds; a short call timeout keeps lease refreshes (every ttl/3)
    # from stalling, and it stays within connect_timeout, which bounds descriptor lookups.
    timeout = min(config.connect_timeout, _ETCD_TIMEOUT)
    return EtcdMetadata(config.metadata, ttl=config.metadata_ttl, timeout=timeout)


def _fail(batch: BatchState, indices: Iterable[int], error: KVConnectError) -> None:
    for index in indices:
        batch.fail(index, error)


def _check_request(op: TransferOp, request: TransferRequest) -> None:
    if not isinstance(request, TransferRequest):
        raise InvalidRequest(f"expected TransferRequest, got {type(request).__name__}")
    if request.length <= 0:
        raise InvalidRequest(f"length must be > 0, got {request.length}")
    if request.local_offset < 0 or request.local_offset + request.length > request.local.length:
        raise InvalidRequest(
            f"local range [{request.local_offset}, {request.local_offset + request.length}) "
            f"is outside region {request.local.id} of {request.local.length} bytes"
        )
    if request.remote_offset < 0:
        raise InvalidRequest(f"remote_offset must be >= 0, got {request.remote_offset}")
    if request.local.kind is MemoryKind.FILE:
        raise InvalidRequest(f"region {request.local.id} is a FILE region: only peers read it")
    if op is TransferOp.READ and not request.local.writable:
        raise InvalidRequest(f"cannot READ into read-only region {request.local.id}")


def _check_remote(op: TransferOp, request: TransferRequest, region: RegionInfo) -> None:
    if request.remote_offset + request.length > region.length:
        raise AccessDenied(
            f"remote range [{request.remote_offset}, {request.remote_offset + request.length}) "
            f"is outside region {region.id} of {region.length} bytes"
        )
    if op is TransferOp.WRITE and not region.writable:
        raise AccessDenied(f"remote region {region.id} is read-only")
