"""kv_transfer_params (kvconnect/vllm/params.py): pure, every environment."""

from __future__ import annotations

import pytest

from kvconnect.vllm.params import prefill_params, remote_prefill


def test_params_round_trip_and_tolerate_extra_keys() -> None:
    params = prefill_params(
        engine_id="e", request_id="r", host="h", port=5, block_ids=[[3, 4]], tp_size=2,
        num_tokens=40,
    )  # fmt: skip
    params["prompt_token_ids"] = [1, 2]  # added by vLLM's OpenAI layer
    remote = remote_prefill(params)
    assert remote is not None
    assert (remote.engine_id, remote.request_id, remote.endpoint) == ("e", "r", "tcp://h:5")
    assert (remote.block_ids, remote.tp_size, remote.num_tokens) == (((3, 4),), 2, 40)
    params["remote_block_ids"] = [7, 8]  # older vLLM: one flat list
    assert remote_prefill(params).block_ids == ((7, 8),)  # type: ignore[union-attr]
    params["remote_block_ids"] = [[1, 2, 3], [2, 3], []]  # hybrid: one list per group
    assert remote_prefill(params).block_ids == ((1, 2, 3), (2, 3), ())  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "change",
    [
        {"remote_port": "5"},
        {"remote_block_ids": []},
        {"remote_block_ids": [[]]},
        {"remote_block_ids": [[1], 2]},
        {"remote_block_ids": [[1]] * 65},
        {"remote_host": ""},
        {"tp_size": -1},
    ],
)
def test_malformed_params_mean_computing_locally(change: dict[str, object]) -> None:
    params = prefill_params(
        engine_id="e", request_id="r", host="h", port=5, block_ids=[[1]], tp_size=1, num_tokens=1
    )
    assert remote_prefill(params | change) is None
    assert remote_prefill({"do_remote_decode": True}) is None
