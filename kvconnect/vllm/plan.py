"""What the scheduler side tells the workers each step (inside vLLM's connector metadata).

Plain frozen dataclasses: vLLM pickles the metadata along with the scheduler output, between
processes of the same engine (never over the network).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconnect.vllm.params import RemotePrefill


@dataclass(frozen=True, slots=True)
class RecvJob:
    """Decode: read ``remote_blocks`` of a prefill engine into ``local_blocks``."""

    request_id: str
    remote: RemotePrefill
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PoolJob:
    """Load (or save) the blocks named by ``hashes`` into (from) ``blocks``."""

    request_id: str
    hashes: tuple[str, ...]
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepPlan:
    recv: tuple[RecvJob, ...] = ()
    load: tuple[PoolJob, ...] = ()
    save: tuple[PoolJob, ...] = ()
    held: tuple[str, ...] = ()
    """Prefill requests finished since the last plan whose blocks stay allocated for decode.
    Every worker reports each of them finished sending once it is released and its save (if
    any) is done, also when it is released in this very plan."""
    released: tuple[str, ...] = ()
    """Held requests whose blocks may be freed now: held in this plan or an earlier one (decode
    may confirm, give up, or let the lease lapse before prefill's next step)."""
    preempted: tuple[str, ...] = ()
    """Requests preempted this step while their blocks were being saved: the forward pass
    must not overwrite those blocks before the saves finished."""
    idle: bool = False
    """vLLM scheduled no tokens this step: it only polls the connector (and steps again soon
    while requests wait for KV or hold blocks for decode)."""
