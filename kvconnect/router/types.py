"""The values the router's parts exchange: instances as a policy sees them, requests, choices.

Plain frozen records with no behaviour, so the index, the cost model, the policies and the HTTP
front share them without importing one another.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.Enum):
    """What an instance does in the fleet: prefill only, decode only, or both (one hop)."""

    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"


@dataclass(frozen=True, slots=True)
class Load:
    """One instance's load as its ``/metrics`` last showed it (lags by up to a health interval)."""

    running: int = 0  # vllm:num_requests_running
    waiting: int = 0  # vllm:num_requests_waiting
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1


@dataclass(frozen=True, slots=True)
class Candidate:
    """What a policy sees of one healthy instance for one request."""

    name: str  # the instance's URL: its id everywhere
    role: Role
    load: Load
    inflight: int  # requests the router sent there that have not finished
    inflight_tokens: int  # their uncached prompt tokens not yet prefilled (the router's count)
    cached_blocks: int  # leading blocks of this request the instance holds (from the index)
    ours_in_load: int  # the router's requests ``load.waiting`` may count (finished or not)


@dataclass(frozen=True, slots=True)
class Request:
    """What a policy sees of a request."""

    blocks: tuple[int, ...]  # the router's hash chain of the prompt's full blocks
    prompt_tokens: int
    pool_blocks: int  # leading blocks the shared pool (kvconnect's store) holds


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a request goes, and what the policy expected of it."""

    instance: str
    predicted_ttft: float  # seconds; 0.0 for policies without a cost model
    cached_blocks: int


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives in seconds; ``None`` leaves that one unchecked."""

    ttft: float | None = None
    tbt: float | None = None


class Breach(enum.StrEnum):
    """Which objective a request would break."""

    TTFT = "ttft"
    TBT = "tbt"


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request is refused before dispatch, and when a retry may fit (seconds)."""

    reason: Breach  # a str: "ttft" or "tbt"
    retry_after: float
