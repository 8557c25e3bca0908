"""Where kvconnect's threads run (kvconnect/vllm/affinity.py): every environment."""

from __future__ import annotations

import os
import threading

import pytest

from kvconnect.errors import ConfigError


def _affinity_of_threads(io_cpus: frozenset[int], model_core: int) -> list[set[int]]:
    """Affinity of a thread started under ``threads_on(io_cpus)`` by a thread pinned to
    ``model_core`` (as vLLM pins its CPU worker's model thread), then of that thread itself."""
    from kvconnect.vllm.affinity import threads_on

    seen: list[set[int]] = []

    def model_thread() -> None:
        os.sched_setaffinity(0, {model_core})
        with threads_on(io_cpus):
            child = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            child.start()
            child.join()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    return seen


def test_kvconnect_threads_inherit_the_model_threads_cores_unless_io_cpus_says() -> None:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        pytest.skip("needs two CPUs and sched_setaffinity")
    first, last = cpus[0], cpus[-1]
    assert _affinity_of_threads(frozenset(), first) == [{first}, {first}]
    assert _affinity_of_threads(frozenset({last}), first) == [{last}, {first}]


def test_io_cpus_the_process_cannot_use_are_a_config_error() -> None:
    from kvconnect.vllm.affinity import bind_this_thread

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs sched_setaffinity")
    with pytest.raises(ConfigError, match="io_cpus"):
        bind_this_thread(frozenset({100_000}))


def test_the_switch_interval_is_only_ever_lowered() -> None:
    import sys

    from kvconnect.vllm.affinity import lower_switch_interval

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        lower_switch_interval(0.0002)
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        lower_switch_interval(0.001)  # above the current one
        lower_switch_interval(0)  # leave it
        assert sys.getswitchinterval() == pytest.approx(0.0002)
    finally:
        sys.setswitchinterval(before)
