"""The scheduler side's own decisions (kvconnect/vllm/scheduler.py) with duck-typed requests:
every environment. tests/vllm/test_scheduler.py drives it through vLLM's real Scheduler (vLLM
environments only)."""

from __future__ import annotations


class _Request:
    def __init__(self, rid: str, prompt: int, computed: int) -> None:
        self.request_id = rid
        self.kv_transfer_params = None
        self.num_prompt_tokens = prompt
        self.num_computed_tokens = computed
        self.block_hashes = [bytes([i]) * 4 for i in range(prompt // 4)]


class _Pool:
    usable = True

    def ask(self, request_id: str, first: int, hashes: object) -> int | None:
        return 0

    def forget(self, request_id: str) -> None:
        pass


def test_saves_are_planned_once_and_preempted_saves_are_protected() -> None:
    from kvconnect.vllm.scheduler import ConnectorScheduler

    scheduler = ConnectorScheduler(engine_id="e", host="h", tp_size=1, block_size=4, pool=_Pool())
    request = _Request("r", prompt=10, computed=4)
    scheduler.on_new_request(request)
    blocks = {"r": [[7, 8, 9]]}
    plan = scheduler.build_plan({"r": 3}, blocks.__getitem__)
    assert plan.save == (), "the prompt is not complete after this step"
    request.num_computed_tokens = 7
    plan = scheduler.build_plan({"r": 3}, blocks.__getitem__)
    (save,) = plan.save  # two full blocks of four tokens
    assert save.blocks == ((7, 8),)
    assert save.hashes == (b"\0\0\0\0".hex(), b"\1\1\1\1".hex())
    assert scheduler.build_plan({"r": 1}, blocks.__getitem__).save == (), "saved once"
    plan = scheduler.build_plan({}, blocks.__getitem__, preempted=["r", "other"])
    assert plan.preempted == ("r",)
    assert scheduler.request_finished(request, [[7, 8, 9]], completed=True) == (True, None)
