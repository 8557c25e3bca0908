"""A throwaway etcd server (Debian's ``etcd-server``) on 127.0.0.1 for tests and benchmarks."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

from kvconnect.lifecycle import Closing
from kvconnect.store.launch import free_port


def etcd_available() -> bool:
    """Whether an ``etcd`` binary is installed."""
    return shutil.which("etcd") is not None


class EtcdServer(Closing):
    """One etcd member with a temporary data dir; restartable on the same ports and data."""

    def __init__(self, host: str = "127.0.0.1", extra_hosts: tuple[str, ...] = ()) -> None:
        """``extra_hosts``: more addresses to serve clients on (same port)."""
        self.host = host
        self.extra_hosts = extra_hosts
        self.client_port = free_port()
        self.peer_port = free_port()
        self._dir = tempfile.mkdtemp(prefix="kvconnect-etcd-")
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            self.start()
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)  # nobody can close() us
            raise

    @property
    def url(self) -> str:
        """``etcd://host:port`` for kvconnect."""
        return f"etcd://{self.host}:{self.client_port}"

    def start(self) -> None:
        """Start (again) and wait until healthy."""
        client = f"http://{self.host}:{self.client_port}"
        listen = ",".join(f"http://{h}:{self.client_port}" for h in (self.host, *self.extra_hosts))
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [
                "etcd",
                "--name",
                "n1",
                "--data-dir",
                self._dir,
                "--listen-client-urls",
                listen,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"n1={peer}",
                "--initial-cluster-state",
                "new",
                "--heartbeat-interval",
                "10",
                "--election-timeout",
                "100",
                "--log-level",
                "error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # Typically a port taken since free_port() chose it: say so now, not in 20 s.
                raise RuntimeError(
                    f"etcd exited with status {self.proc.returncode} "
                    f"(ports {self.client_port}, {self.peer_port} taken?)"
                )
            try:
                health = f"{client}/health"  # http on loopback, built here
                with urllib.request.urlopen(health, timeout=1) as response:  # noqa: S310
                    if b"true" in response.read():
                        return
            except OSError:
                time.sleep(0.05)
        self.kill()  # reaped: an unreaped Popen warns when collected (an error under pytest)
        raise RuntimeError("etcd did not become healthy")

    def kill(self) -> None:
        """SIGKILL and reap (the data dir stays for a restart)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def close(self) -> None:
        """Stop and delete the data. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
