"""The vLLM API servers the benchmarks and end-to-end tests start
(kvconnect.bench.vllm_servers.py): pure, every environment."""

from __future__ import annotations

import pytest

from kvconnect.bench.vllm_servers import cpu_groups


def test_instances_on_one_host_get_disjoint_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4})
    assert cpu_groups(2) == ["0,1", "2,3"]
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {1})
    with pytest.raises(ValueError, match="2 groups need 2 cores"):
        cpu_groups(2)
