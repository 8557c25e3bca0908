"""kvconnect commands in child processes on loopback: ``kvconnect demo`` and ``kvconnect bench``
start their stores with it, and the test suite its clusters (which is why it ships: the
shipped commands need it, and tests import this one rather than a copy).

    with Cluster(servers=3, server_size=64 << 20) as cluster:
        client = StoreClient(StoreClientConfig(master=cluster.master_endpoint))

Processes are started with the real command line (``python -m kvconnect.cli master|store``);
each is a :class:`Process` that can be killed, stopped and restarted by tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

from kvconnect._config import cluster_token
from kvconnect.lifecycle import Closing
from kvconnect.store import messages as m
from kvconnect.store.rpc import RpcClient

_GIVEN: set[int] = set()
_GIVING = threading.Lock()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, and never one this process was given before:
    the kernel may hand the same free port to two probes in a row, and two servers told to
    bind it would race for it."""
    with _GIVING:
        while True:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = int(probe.getsockname()[1])
            if port not in _GIVEN:
                _GIVEN.add(port)
                return port


class Process:
    """A kvconnect command in a child process; ready once it printed its banner line."""

    def __init__(
        self, args: Sequence[str], ready: str, timeout: float = 30.0, netns: str | None = None
    ) -> None:
        """``netns``: run inside that network namespace (``ip netns exec``)."""
        self.args = [sys.executable, "-m", "kvconnect.cli", *args]
        if netns is not None:
            self.args = ["ip", "netns", "exec", netns, *self.args]
        self._ready = ready
        self._timeout = timeout
        self.proc: subprocess.Popen[str] | None = None
        self._stderr: IO[str] | None = None
        self.last_stderr = ""
        self.banner = ""
        self.start()

    def start(self) -> None:
        """(Re)start the command and wait for its banner."""
        # stderr to a file, not a pipe: a chatty child must never block on a full pipe
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in _reap
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=self._stderr, text=True
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if self._ready in line:
                self.banner = line.strip()
                return
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"{' '.join(self.args)} did not start: {self.stderr()[-2000:]}")

    def stderr(self) -> str:
        """What the process wrote to stderr (so far, or before it was reaped)."""
        if self._stderr is None:
            return self.last_stderr
        self._stderr.seek(0)
        return self._stderr.read()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self._reap()

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` (SIGSTOP/SIGCONT in tests)."""
        os.kill(self.pid, sig)

    def stop(self) -> None:
        """SIGTERM (graceful), then SIGKILL after a grace period; reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._reap()

    def _reap(self) -> None:
        if self.proc is None:
            return
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._stderr is not None:
            self.last_stderr = self.stderr()
            self._stderr.close()
            self._stderr = None


class Cluster(Closing):
    """One master and ``servers`` store servers, each in its own process."""

    def __init__(
        self,
        servers: int = 1,
        server_size: int = 64 << 20,
        master_args: Sequence[str] = (),
        server_args: Sequence[str] = (),
        token_file: str = "",
        host: str = "127.0.0.1",
        netns: str | None = None,
    ) -> None:
        """``token_file``: the cluster's own token (default: the user's default token);
        ``host``: the address its master and servers listen on, inside network namespace
        ``netns`` if given."""
        self.master_endpoint = f"tcp://{host}:{free_port()}"
        self.token_file = token_file
        self._netns = netns
        auth = ["--token-file", token_file] if token_file else []
        self._master_args = [
            "master",
            *auth,
            "--master-listen",
            self.master_endpoint,
            *master_args,
        ]
        self._server_args = [
            "store",
            *auth,
            "--store-master",
            self.master_endpoint,
            "--store-size",
            str(server_size),
            "--transfer-listen-host",
            host,
            *server_args,
        ]
        self.master = Process(self._master_args, "listening on", netns=netns)
        self.servers: list[Process] = []
        try:
            for _ in range(servers):
                self.add_server()
        except BaseException:
            self.close()
            raise

    def add_server(self, *args: str) -> Process:
        """Start one more store server (``args`` override the cluster's, e.g. its size)."""
        server = Process([*self._server_args, *args], "kvconnect store server", netns=self._netns)
        self.servers.append(server)
        return server

    def stats(self, timeout: float = 2.0) -> m.StatsReply:
        """The master's stats (raises MasterUnavailable if it does not answer)."""
        token = cluster_token(None, self.token_file, False)
        rpc = RpcClient(self.master_endpoint, timeout, token=token)
        try:
            reply = rpc.call(m.Stats())
        finally:
            rpc.close()
        if not isinstance(reply, m.StatsReply):
            raise RuntimeError(f"unexpected reply to stats: {reply!r}")
        return reply

    def restart_master(self) -> None:
        """Start the master again on the same endpoint (after it was killed)."""
        self.master.start()

    def close(self) -> None:
        """Stop everything. Idempotent."""
        for server in self.servers:
            server.stop()
        self.master.stop()
