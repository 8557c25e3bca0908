"""A vLLM prefill engine's kvconnect side in its own process, without vLLM: one worker (KV
cache registered with its transfer engine) and the side channel with its lease table.

Tests put it beside a decode worker to stop (SIGSTOP) or kill a real prefill::

    with PrefillPeer(seed=1) as prefill:
        prefill.hold("p1")
        job = RecvJob("d1", prefill.remote("p1", (2,)), ((5,),), ((2,),))
        ...
        assert prefill.digest((2,)) == block_digest(decode_caches, (5,))

The child prints one hello line (side-channel port, pid, engine id), then answers one JSON
command per line until stdin closes: ``hold``, ``renewals`` (Renew calls received, by request
id), ``calls`` (side-channel calls received, by kind), ``digest``. Given a ``port``, a new peer
replaces a killed one at the same side-channel endpoint (with another engine id).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kvconnect._config import cluster_token
from kvconnect.testing.peer import ChildProcess
from kvconnect.vllm import messages as msg
from kvconnect.vllm.config import VllmConnectorConfig
from kvconnect.vllm.params import RemotePrefill
from kvconnect.vllm.pd import PrefillService
from kvconnect.vllm.worker import ConnectorWorker, EngineFormat
from tests.support.child import child_env

BLOCKS = 16
FORMAT = EngineFormat(model="m", dtype="float32", block_size=4, tp_rank=0, tp_size=1)
_LAYERS = ("model.layers.0.attn", "model.layers.1.attn")


def kv_caches(seed: int | None, layout: str = "kv_first", blocks: int = BLOCKS) -> dict[str, Any]:
    """Two float32 layers of ``blocks`` blocks (``kv_first``: K/V outermost); random from
    ``seed``, or zeros when it is None. Imports torch."""
    import torch

    shape = (2, blocks, 4, 2, 8) if layout == "kv_first" else (blocks, 2, 4, 16)
    generator = torch.Generator().manual_seed(seed or 0)
    return {
        name: torch.randn(*shape, generator=generator) if seed is not None else torch.zeros(*shape)
        for name in _LAYERS
    }


@contextmanager
def decode_worker(config: VllmConnectorConfig) -> Iterator[tuple[ConnectorWorker, dict[str, Any]]]:
    """A decode rank's worker side over empty :func:`kv_caches`, registered, and its caches."""
    caches = kv_caches(seed=None)
    worker = ConnectorWorker(config, FORMAT, BLOCKS)
    try:
        worker.register(caches)
        yield worker, caches
    finally:
        worker.close()


def block_digest(caches: Mapping[str, Any], blocks: Sequence[int]) -> str:
    """SHA-256 over ``blocks`` of every layer of K/V-outermost ``caches``."""
    digest = hashlib.sha256()
    for name in sorted(caches):
        for block in blocks:
            digest.update(caches[name][:, block].contiguous().numpy().tobytes())
    return digest.hexdigest()


class PrefillPeer(ChildProcess):
    """Start ``python -m tests.support.prefill_peer`` and talk to it."""

    def __init__(
        self, *, seed: int, lease: float = 30.0, port: int = 0, timeout: float = 60.0
    ) -> None:
        """``seed``: the KV cache's contents (:func:`kv_caches`); ``lease``: prefill's lease;
        ``port``: the side channel's (0: a free one)."""
        args = [sys.executable, "-m", "tests.support.prefill_peer"]
        args += ["--seed", str(seed), "--lease", str(lease), "--port", str(port)]
        super().__init__(args, env=child_env(), timeout=timeout)
        self.port: int = self.hello["port"]
        self.engine_id: str = self.hello["engine_id"]

    def remote(self, request_id: str, blocks: Sequence[int]) -> RemotePrefill:
        """What decode learns from ``kv_transfer_params`` about held request ``request_id``."""
        return RemotePrefill(
            self.engine_id, request_id, "127.0.0.1", self.port, (tuple(blocks),), 1, None
        )

    def hold(self, request_id: str) -> None:
        """Keep ``request_id``'s blocks for one decode reader (as ``request_finished``)."""
        self.call({"cmd": "hold", "request_id": request_id})

    def renewals(self) -> dict[str, int]:
        """How many Renew calls named each request so far."""
        return dict(self.call({"cmd": "renewals"})["renewals"])

    def calls(self) -> dict[str, int]:
        """How many side-channel calls of each kind (``GetLayout``, ``Renew``…) arrived."""
        return dict(self.call({"cmd": "calls"})["calls"])

    def digest(self, blocks: Sequence[int]) -> str:
        """:func:`block_digest` of the peer's KV cache."""
        return str(self.call({"cmd": "digest", "blocks": list(blocks)})["digest"])

    def _what(self) -> str:
        return "prefill peer"


# ------------------------------------------------------------------------------ child side


class _CountingService(PrefillService):
    """The real service, counting the renewals it answers (what the tests observe)."""

    def __init__(self, engine_id: str, lease: float, port: int) -> None:
        super().__init__(engine_id, "127.0.0.1", port, lease, token=cluster_token(None, "", False))
        self.renewals: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def _handle(self, request: msg.Request) -> msg.Reply:
        self.calls[type(request).__name__] += 1
        if isinstance(request, msg.Renew):
            self.renewals.update(request.request_ids)
        return super()._handle(request)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the child process."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    caches = kv_caches(args.seed)
    worker = ConnectorWorker(VllmConnectorConfig.from_mapping({"transport": "tcp"}), FORMAT, BLOCKS)
    engine_id = f"prefill-{os.getpid()}"  # decode knows prefill engines by their id
    service = _CountingService(engine_id, args.lease, args.port)
    try:
        service.set_layouts({0: worker.register(caches)})
        service.start()
        hello = {"port": service.port, "pid": os.getpid(), "engine_id": engine_id}
        print(json.dumps(hello), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            reply: dict[str, Any] = {"ok": True}
            if command["cmd"] == "hold":
                service.hold(command["request_id"])
            elif command["cmd"] == "renewals":
                reply = {"renewals": dict(service.renewals)}
            elif command["cmd"] == "calls":
                reply = {"calls": dict(service.calls)}
            elif command["cmd"] == "digest":
                reply = {"digest": block_digest(caches, command["blocks"])}
            print(json.dumps(reply), flush=True)
    finally:
        service.close()
        worker.close()


if __name__ == "__main__":
    main()
