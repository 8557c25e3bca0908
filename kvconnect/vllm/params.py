"""``kv_transfer_params``: what prefill hands the proxy and the proxy hands decode. Pure.

The keys are NIXL's, so proxies written for vLLM's NixlConnector work unchanged. Keys this
module does not know are ignored (the OpenAI layer adds some, e.g. ``prompt_token_ids``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvconnect.vllm.groups import GroupBlocks

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where decode finds a request's KV: prefill's blocks, held for it under a lease."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: GroupBlocks
    """Per KV-cache group, the blocks holding what decode needs."""
    tp_size: int
    num_tokens: int | None

    @property
    def endpoint(self) -> str:
        """The prefill engine's side channel."""
        return f"tcp://{self.host}:{self.port}"


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """The proxy asked this (prefill) engine to keep the KV for a decode engine."""
    return bool(params and params.get("do_remote_decode"))


def remote_prefill(params: Mapping[str, Any] | None) -> RemotePrefill | None:
    """The remote prefill of a decode request, or None when it has none (or it is malformed:
    then the request is logged and computed locally rather than failed)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    try:
        return RemotePrefill(
            engine_id=_text(params, "remote_engine_id"),
            request_id=_text(params, "remote_request_id"),
            host=_text(params, "remote_host"),
            port=_integer(params.get("remote_port"), "remote_port"),
            block_ids=_block_ids(params.get("remote_block_ids")),
            tp_size=_integer(params.get("tp_size", 1), "tp_size"),
            num_tokens=(
                None
                if params.get("remote_num_tokens") is None
                else _integer(params["remote_num_tokens"], "remote_num_tokens")
            ),
        )
    except ValueError as exc:
        log.error("ignoring malformed kv_transfer_params (%s): %r", exc, dict(params))
        return None


def prefill_params(
    *,
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    block_ids: Sequence[Sequence[int]],
    tp_size: int,
    num_tokens: int,
) -> dict[str, Any]:
    """What prefill's ``request_finished`` returns for decode (via the proxy); ``block_ids``
    per KV-cache group."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(ids) for ids in block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "remote_num_tokens": num_tokens,
        "transfer_mode": "pull",
    }


def _text(params: Mapping[str, Any], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _integer(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
    return value


_MAX_GROUPS = 64  # hostile input: vLLM models have a handful of KV-cache groups


def _block_ids(value: Any) -> GroupBlocks:
    # vLLM 0.33 sends one list per KV cache group, older ones a flat list.
    if isinstance(value, list) and value and not isinstance(value[0], list):
        value = [value]
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= _MAX_GROUPS
        or not all(isinstance(ids, list) for ids in value)
        or not any(value)
    ):
        raise ValueError(
            f"remote_block_ids must be a list of block id lists per KV-cache group, not all "
            f"empty; got {value!r}"
        )
    return tuple(tuple(_integer(v, "remote_block_ids") for v in ids) for ids in value)
