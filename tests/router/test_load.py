"""An instance's load from vLLM's /metrics text."""

from __future__ import annotations

import pytest

from kvconnect.errors import ProtocolError
from kvconnect.router.load import parse_load
from kvconnect.router.types import Load

# The shape vLLM serves: HELP/TYPE lines, one series per engine, other families around.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1234.0
"""


def test_engines_are_summed_and_kv_usage_averaged() -> None:
    assert parse_load(VLLM_METRICS) == Load(running=5, waiting=4, kv_usage=0.375)


def test_absent_gauges_count_as_idle() -> None:
    assert parse_load("# TYPE other gauge\nother 1.0\n") == Load()
    assert parse_load("") == Load()


def test_nonsense_values_are_clamped() -> None:
    text = 'vllm:num_requests_running -3\nvllm:kv_cache_usage_perc{engine="0"} 7\n'
    assert parse_load(text) == Load(running=0, waiting=0, kv_usage=1.0)


@pytest.mark.parametrize("text", ["garbage {{{", "a b c d e", 'x{a="1} 2', "\x00\x01"])
def test_what_is_not_prometheus_text_is_a_protocol_error(text: str) -> None:
    with pytest.raises(ProtocolError):
        parse_load(text)
