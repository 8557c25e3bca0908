"""perftest (``ib_write_bw``/``ib_read_bw``), the same-run baseline of the rdma transport.

perftest runs its server and client on the same device (two processes, RC, one QP), moving
``count * batches`` messages of ``block`` bytes; its average bandwidth is turned into per-batch
seconds so it reads like the other baselines.
"""

from __future__ import annotations

import shutil
import subprocess
import time

from kvconnect.store.launch import free_port
from kvconnect.transfer.transports.rdma import verbs as rdma_verbs

_PERFTEST_MB = 1 << 20  # perftest's "MB" in its MB/sec columns
_START_TIMEOUT = 60.0
_RUN_TIMEOUT = 600.0


def perftest_available() -> bool:
    """perftest is installed and an RDMA device is present."""
    return bool(shutil.which("ib_write_bw") and rdma_verbs.device_names())


class PerftestBaseline:
    """``ib_write_bw``/``ib_read_bw`` between two processes on the first RDMA device."""

    name = "perftest"

    def __init__(self) -> None:
        self.device = rdma_verbs.device_names()[0]
        nic = rdma_verbs.Nic(self.device, None)
        self.gid_index = nic.gid_index  # the RoCE v2 GID the transport uses, too
        nic.close()

    def run(self, op: str, block: int, count: int, batches: int) -> list[float]:
        iterations = count * batches
        bytes_per_second = self._bandwidth(op, block, iterations)
        return [block * count / bytes_per_second] * batches

    def close(self) -> None:
        """Nothing stays running between runs."""

    def _bandwidth(self, op: str, block: int, iterations: int) -> float:
        tool = "ib_write_bw" if op == "write" else "ib_read_bw"
        port = free_port()
        args = [tool, "-d", self.device, "-x", str(self.gid_index), "-s", str(block)]
        args += ["-n", str(iterations), "-F", "-p", str(port)]
        with subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as server:
            try:
                out = _client([*args, "127.0.0.1"])
            finally:
                try:
                    server.wait(timeout=_START_TIMEOUT)
                except subprocess.TimeoutExpired:  # the client never reached it
                    server.kill()
        return _average_mb(out) * _PERFTEST_MB


def _client(args: list[str]) -> str:
    """Run the client, retrying while the server is not listening yet."""
    deadline = time.monotonic() + _START_TIMEOUT
    while True:
        done = subprocess.run(
            args, capture_output=True, text=True, timeout=_RUN_TIMEOUT, check=False
        )
        if done.returncode == 0:
            return done.stdout
        if time.monotonic() > deadline:
            raise RuntimeError(f"{args[0]} failed: {done.stderr.strip() or done.stdout[-500:]}")
        time.sleep(0.2)


def _average_mb(output: str) -> float:
    """BW average [MB/sec] from perftest's result line (#bytes #iterations peak average rate)."""
    for line in output.splitlines():
        fields = line.split()
        if len(fields) == 5 and fields[0].isdigit():
            return float(fields[3])
    raise RuntimeError(f"no result line in perftest output:\n{output}")
