"""The connector's worker half with sync loads: waited for in start_load_kv, never reported
finished or failed (vLLM asserts on that), a failure's blocks reported invalid; other requests'
results stepped during the wait are reported by the step's results."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from actors.engine.vllm.connector.metadata import RayNixlMetadata, RecvSpec  # noqa: E402
from actors.engine.vllm.connector.worker import ConnectorWorker, merge_steps  # noqa: E402
from actors.kv.plan.pull_types import StepResult  # noqa: E402
from actors.transfer_config import TransferConfig  # noqa: E402


class FakeTransfer:
    """Steps scripted StepResults; pulls start and end as the script says."""

    def __init__(self, script):
        self.script, self.started = list(script), []

    def start_pull(self, req_id, req, directory):
        self.started.append(req_id)

    def refresh_peers(self, agents):
        pass

    def step(self):
        return self.script.pop(0) if self.script else StepResult()


def worker(script):
    w = ConnectorWorker.__new__(ConnectorWorker)
    w.transfer, w._load_errors, w._stepped, w._sync_ids = TransferConfig(read_timeout_s=5), set(), [], set()
    w._expired, w._dropped, w._failed = set(), set(), {}
    w.xfer = FakeTransfer(script)
    w._start = lambda req_id, recv: w.xfer.start_pull(req_id, None, None)
    return w


def recv(sync, blocks=(1, 2)):
    return RecvSpec(params=SimpleNamespace(), local_block_ids=blocks, remote_block_ids=blocks, num_tokens=32,
                    sync=sync)


def test_sync_loads_are_waited_for_and_never_reported():
    w = worker([StepResult(released=("p-1",)),
                StepResult(done={"s-ok": 0.001, "a-1": 0.002}),
                StepResult(failed={"s-bad": "boom"}, invalid_block_ids={"s-bad": (7, 8)})])
    meta = RayNixlMetadata(recv={"s-ok": recv(True), "s-bad": recv(True, (7, 8)), "a-2": recv(False)})
    w.start_load_kv(meta)
    assert not w.xfer.script  # stepped until both sync loads ended
    sending, recving, failed = w.get_transfer_results()
    assert sending == {"p-1"} and recving == {"a-1"} and failed == set()
    assert w.get_block_ids_with_load_errors() == {7, 8}  # the failed sync load: recomputed or failed by vLLM
    assert w.worker_meta().failed_pulls == (("s-bad", "boom"),)  # why, for the EngineActor (connector stats)
    assert w._sync_ids == set()


def test_merge_steps_keeps_everything():
    a = StepResult(done={"x": 1.0}, released=("l1",))
    b = StepResult(failed={"y": "r"}, invalid_block_ids={"y": (3,)}, expired=("l2",))
    m = merge_steps([a, b])
    assert m.done == {"x": 1.0} and m.failed == {"y": "r"} and m.invalid_block_ids == {"y": (3,)}
    assert m.released == ("l1",) and m.expired == ("l2",) and m.finished_recving == {"x", "y"}


class StuckTransfer(FakeTransfer):
    """A pull that never ends by itself (a partitioned producer): only `fail_pull` ends it, and the
    step after reports it failed with its blocks invalid, as the real RankTransfer does."""

    def __init__(self):
        super().__init__([])
        self.failing: dict[str, str] = {}

    def fail_pull(self, req_id, reason):
        self.failing[req_id] = reason

    def step(self):
        failed, self.failing = self.failing, {}
        return StepResult(failed=failed, invalid_block_ids={r: (4, 5) for r in failed})


def test_a_sync_load_not_done_within_sync_wait_s_fails_instead_of_holding_the_engine():
    import time

    w = worker([])
    w.transfer = TransferConfig(read_timeout_s=30, sync_wait_s=0.2)
    w.xfer = StuckTransfer()
    t0 = time.monotonic()
    w.start_load_kv(RayNixlMetadata(recv={"s-stuck": recv(True, (4, 5))}))
    waited = time.monotonic() - t0
    assert 0.2 <= waited < 1.0  # the budget, not the 30 s read timeout
    w.get_transfer_results()
    assert w.get_block_ids_with_load_errors() == {4, 5}  # recomputed (or failed) by vLLM's policy
    assert w.worker_meta().failed_pulls == (("s-stuck", "sync load not done within 0.2 s"),)
