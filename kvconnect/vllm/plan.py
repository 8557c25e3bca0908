"""What the scheduler side tells the workers each step (inside vLLM's connector metadata).

Plain frozen dataclasses: vLLM pickles the metadata along with the scheduler output, between
processes of the same engine (never over the network).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconnect.vllm.groups import GroupBlocks
from kvconnect.vllm.params import RemotePrefill


@dataclass(frozen=True, slots=True)
class RecvJob:
    """Decode: read a prefill engine's KV into ``local_blocks``: per KV-cache group, paired
    with ``remote_blocks`` (equal lengths, the same positions of the prompt). ``first_token``:
    the tokens decode had (where ``local_blocks`` start); with block sizes that differ between
    the two sides the worker maps tokens from every block prefill holds
    (``remote.block_ids``) instead of the pairs."""

    request_id: str
    remote: RemotePrefill
    local_blocks: GroupBlocks
    remote_blocks: GroupBlocks
    first_token: int = 0


@dataclass(frozen=True, slots=True)
class PoolJob:
    """Load (or save) the blocks named by ``hashes`` into (from) ``blocks``: per KV-cache
    group, one block per hash (``blocks[g][i]`` holds group ``g``'s part of ``hashes[i]``),
    :data:`~kvconnect.vllm.groups.NULL_BLOCK` where the group moves nothing (positions a
    sliding window does not need)."""

    request_id: str
    hashes: tuple[str, ...]
    blocks: GroupBlocks


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
    """Requests preempted this step while their blocks were being saved, or whose save
    started last step reads sliding-window blocks vLLM may free this step: the forward pass
    must not overwrite those blocks before the saves finished."""
    idle: bool = False
    """vLLM scheduled no tokens this step: it only polls the connector (and steps again soon
    while requests wait for KV or hold blocks for decode)."""
