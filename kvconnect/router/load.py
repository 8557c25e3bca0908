"""An instance's load from its ``/metrics``: vLLM's scheduler gauges in Prometheus text.

vLLM labels each series by engine (data-parallel rank) and model: the router sums running and
waiting requests over the engines and averages their KV-cache usage. A gauge that is absent
counts as 0 (an instance exposing none of them looks idle).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvconnect.errors import ProtocolError
from kvconnect.router.types import Load

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
_WANTED = (RUNNING, WAITING, KV_USAGE)


def parse_load(text: str) -> Load:
    """The load in ``text`` (a ``/metrics`` body); ProtocolError if it is not Prometheus text.

    Pure; the caller bounds the size of ``text``."""
    values: dict[str, list[float]] = {name: [] for name in _WANTED}
    try:
        for family in text_string_to_metric_families(text):
            if family.name in values:
                values[family.name].extend(
                    sample.value for sample in family.samples if sample.name == family.name
                )
    except (ValueError, TypeError, IndexError) as exc:
        raise ProtocolError(f"malformed Prometheus text: {exc}") from exc
    usage = values[KV_USAGE]
    return Load(
        running=_count(values[RUNNING]),
        waiting=_count(values[WAITING]),
        kv_usage=min(1.0, max(0.0, sum(usage) / len(usage))) if usage else 0.0,
    )


def _count(samples: list[float]) -> int:
    """The sum of gauge samples as a request count (negative or NaN samples count 0)."""
    return int(sum(value for value in samples if value > 0))
