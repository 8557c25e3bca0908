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
    """Finished prefill requests whose blocks stay allocated for decode (until released)."""
    released: tuple[str, ...] = ()
    """Held requests whose blocks may be freed now."""
    preempted: tuple[str, ...] = ()
    """Requests preempted this step while their blocks were being saved: the forward pass
    must not overwrite those blocks before the saves finished."""
