"""Prefill/decode disaggregation, scheduler-process services (threads and sockets).

:class:`PrefillService` runs in the prefill engine's scheduler process: the side channel that
hands out the KV layout, and the lease table deciding when held blocks may be freed.
:class:`LeaseKeeper` runs in the decode engine's scheduler process: it renews prefill's leases
for requests still waiting for their KV and tells prefill about blocks it will not read. Its
calls to each prefill engine run in a lane of their own (one thread per engine), so a prefill
that does not answer delays no other's renewals.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable

from kvconnect.errors import KVConnectError
from kvconnect.vllm import messages as msg
from kvconnect.vllm.lanes import Lanes
from kvconnect.vllm.layout import RankLayout
from kvconnect.vllm.leases import Confirmation, LeaseTable
from kvconnect.vllm.params import RemotePrefill
from kvconnect.vllm.sidechannel import SideChannelClient, SideChannelServer

log = logging.getLogger(__name__)


class PrefillService:
    """Leases on blocks kept for decode, and the side channel decode calls."""

    def __init__(
        self,
        engine_id: str,
        host: str,
        port: int,
        lease: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        token: str | None,
    ) -> None:
        self.engine_id = engine_id
        self._clock = clock
        self._lock = threading.Lock()
        self._leases = LeaseTable(lease)
        self._layouts: dict[int, RankLayout] = {}
        self._renewed = 0
        self._server = SideChannelServer(host, port, self._handle, token=token)

    @property
    def port(self) -> int:
        """The side channel's port (after :meth:`start`)."""
        return self._server.port

    @property
    def expired(self) -> int:
        """Leases that lapsed so far."""
        with self._lock:
            return self._leases.expired

    @property
    def renewed(self) -> int:
        """Lease renewals decode asked for so far (one per request per renewal)."""
        with self._lock:
            return self._renewed

    def start(self) -> None:
        self._server.start()

    def close(self) -> None:
        self._server.close()

    def set_layouts(self, layouts: dict[int, RankLayout]) -> None:
        """The workers' layouts, by TP rank (from vLLM's handshake hooks)."""
        with self._lock:
            self._layouts = dict(layouts)

    def hold(self, request_id: str) -> None:
        """Keep ``request_id``'s blocks for decode (until every decode rank that reads them
        confirmed, decode gave them up, or the lease lapsed)."""
        with self._lock:
            self._leases.hold(request_id, self._clock())

    def take_released(self) -> list[str]:
        """Requests whose blocks may be freed now (lapsed leases included)."""
        with self._lock:
            self._leases.expire(self._clock())
            return self._leases.take_released()

    def held(self) -> int:
        with self._lock:
            return len(self._leases)

    def _handle(self, request: msg.Request) -> msg.Reply:
        now = self._clock()
        with self._lock:
            if isinstance(request, msg.GetLayout):
                if not self._layouts:
                    return msg.Ack(False, "prefill workers have not registered their KV cache")
                return msg.LayoutReply(self.engine_id, self._layouts)
            if isinstance(request, msg.Renew):
                self._leases.renew(request.request_ids, now)
                self._renewed += len(request.request_ids)
                return msg.Ack(True)
            if isinstance(request, msg.GiveUp):
                self._leases.give_up(request.request_ids)
                return msg.Ack(True)
            if not 0 <= request.reader < request.readers <= msg.MAX_READERS:
                return msg.Ack(False, f"reader {request.reader} of {request.readers}: invalid")
            outcome = self._leases.confirm(request.request_id, request.reader, request.readers, now)
        if outcome is Confirmation.OK:
            return msg.Ack(True)
        log.warning(
            "decode confirmed a read of %s after its blocks were released (lease lapsed): "
            "decode must not use what it read",
            request.request_id,
        )
        return msg.Ack(False, "blocks released before the read was confirmed (lease lapsed)")


class LeaseKeeper:
    """Renews prefill leases of decode requests still waiting for KV; gives up the others."""

    def __init__(self, client: SideChannelClient, lease: float) -> None:
        self._client = client
        self._interval = max(lease / 6, 0.05)
        self._lanes = Lanes("vllm-lease", 1, on_exit=client.release)
        self._lock = threading.Lock()
        self._waiting: dict[str, RemotePrefill] = {}
        self._give_up: list[RemotePrefill] = []
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="kvconnect-vllm-lease-keeper", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop renewing; waits for calls in flight (each bounded by the client's timeout)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._lanes.close()

    def track(self, request_id: str, remote: RemotePrefill) -> None:
        """Decode request ``request_id`` waits for ``remote``'s blocks."""
        with self._lock:
            self._waiting[request_id] = remote

    def done(self, request_id: str) -> None:
        """The request's KV arrived (or failed): no more renewals."""
        with self._lock:
            self._waiting.pop(request_id, None)

    def give_up(self, request_id: str, remote: RemotePrefill) -> None:
        """Decode will not read ``remote``'s blocks: prefill may free them now."""
        with self._lock:
            self._waiting.pop(request_id, None)
            self._give_up.append(remote)
        self._wake.set()

    def _run(self) -> None:
        next_renewal = time.monotonic() + self._interval
        while not self._stop:
            self._wake.wait(max(0.0, next_renewal - time.monotonic()))
            self._wake.clear()
            with self._lock:
                give_up, self._give_up = self._give_up, []
            self._send(msg.GiveUp, give_up)
            if time.monotonic() >= next_renewal:
                with self._lock:
                    waiting = list(self._waiting.values())
                self._send(msg.Renew, waiting)
                next_renewal = time.monotonic() + self._interval

    def _send(
        self, kind: type[msg.Renew] | type[msg.GiveUp], remotes: Iterable[RemotePrefill]
    ) -> None:
        """One call per prefill engine, each in the engine's lane (never blocks). A renewal
        is skipped while the lane is still busy: the next round renews again, and a queue of
        renewals behind one that hangs would only repeat it."""
        by_endpoint: dict[str, list[str]] = collections.defaultdict(list)
        for remote in remotes:
            by_endpoint[remote.endpoint].append(remote.request_id)
        for endpoint, ids in by_endpoint.items():
            if kind is msg.Renew and self._lanes.busy(endpoint):
                log.debug("prefill %s has not answered yet: renewal skipped", endpoint)
                continue
            self._lanes.submit(endpoint, functools.partial(self._call, endpoint, kind(ids)))

    def _call(self, endpoint: str, request: msg.Renew | msg.GiveUp) -> None:
        try:
            self._client.call(endpoint, request)
        except KVConnectError as exc:  # prefill's leases lapse on their own
            log.warning("%s to %s failed: %s", type(request).__name__, endpoint, exc)
