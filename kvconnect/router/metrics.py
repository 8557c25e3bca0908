"""The router's Prometheus series (``kvconnect_router_*``), in a registry of its own that the
router serves on ``/metrics``.

Updated from the router's event loop; the index size is read when scraped.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvconnect.router.events import SubscriberStats
from kvconnect.router.instances import Instance

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Outcome(enum.StrEnum):
    """How a request ended (the ``outcome`` label)."""

    OK = "ok"
    CLIENT_ERROR = "client_error"  # the router or an instance refused the request (4xx)
    REJECTED = "rejected"  # 429 by the SLO check
    UNAVAILABLE = "unavailable"  # no healthy instance, or every attempt failed to start
    UPSTREAM_ERROR = "upstream_error"  # an instance answered 5xx or broke while answering
    TIMEOUT = "timeout"
    ABORTED = "aborted"  # the client went away before its answer was complete


class _Events(Collector):
    """``kvconnect_router_events_<counter>{source}``: each KV-event subscriber's counters."""

    def __init__(self, stats: Callable[[], Mapping[str, SubscriberStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        snapshot = self._stats()
        for field in dataclasses.fields(SubscriberStats):
            family = CounterMetricFamily(
                f"kvconnect_router_events_{field.name}",
                f"KV-event subscriber counter {field.name} (kvconnect.router.events)",
                labels=["source"],
            )
            for source, stats in snapshot.items():
                family.add_metric([source], getattr(stats, field.name))
            yield family


class RouterMetrics:
    """The series; ``index_entries`` and ``events`` (each subscriber's counters by source)
    are called at each scrape, on the scraping thread."""

    def __init__(
        self,
        index_entries: Callable[[], int],
        events: Callable[[], Mapping[str, SubscriberStats]] = dict,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvconnect_router_requests", "Requests by endpoint and outcome",
            ["endpoint", "outcome"], registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "kvconnect_router_decisions", "Requests sent to each instance, by role",
            ["instance", "role"], registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "kvconnect_router_rejections", "Requests answered 429 by the SLO check, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "kvconnect_router_retries", "Hops retried on another instance (not yet started)",
            ["role"], registry=r,
        )  # fmt: skip
        self.healthy = Gauge(
            "kvconnect_router_instance_healthy", "1 while an instance is in, 0 while out",
            ["instance", "role"], registry=r,
        )  # fmt: skip
        self.prompt_blocks = Counter(
            "kvconnect_router_prompt_blocks", "Full prompt blocks of routed requests", registry=r
        )
        self.cached_blocks = Counter(
            "kvconnect_router_cached_blocks",
            "Leading prompt blocks the chosen instance held (index), or the shared pool",
            ["tier"], registry=r,
        )  # fmt: skip
        self.ttft_predicted = Histogram(
            "kvconnect_router_ttft_predicted_seconds", "TTFT the policy predicted at dispatch",
            registry=r, buckets=_TTFT_BUCKETS,
        )  # fmt: skip
        self.ttft_observed = Histogram(
            "kvconnect_router_ttft_observed_seconds",
            "TTFT observed: prefill's answer (PD) or the first byte (one hop)",
            registry=r, buckets=_TTFT_BUCKETS,
        )  # fmt: skip
        index = Gauge(
            "kvconnect_router_index_entries", "Block hashes held by the prefix index", registry=r
        )
        index.set_function(lambda: float(index_entries()))
        r.register(_Events(events))

    def instance_changed(self, instance: Instance) -> None:
        """A fleet listener: the health gauge follows the instance."""
        self.healthy.labels(instance.url, instance.role.value).set(1 if instance.healthy else 0)

    def render(self) -> bytes:
        """The text exposition of every series."""
        return generate_latest(self.registry)
