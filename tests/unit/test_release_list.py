"""The connector's release list: a prefill nobody will read is freed in the next engine step.

The EngineActor submits an aborted request through vLLM's `notify_kv_transfer_request_rejected`
whose params name the held request; the scheduler half puts it on the step's release list and
the worker half drops the lease in that step (`finished_sending`), so vLLM frees the blocks.
"""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from actors.engine.vllm.connector.scheduler import RELEASE_KEY, ConnectorScheduler  # noqa: E402


def finished(req_id, params, status="FINISHED_LENGTH_CAPPED", computed=40):
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, status=SimpleNamespace(name=status),
                           num_computed_tokens=computed)


def test_a_release_request_puts_the_held_prefill_on_the_next_steps_release_list():
    sched = ConnectorScheduler("P", tp_size=1, pp_size=1, dcp_size=1, block_size=16, lease_ttl_s=30,
                               clock=lambda: 0.0)
    held, params = sched.request_finished(finished("r-abc", {"do_remote_decode": True}), [[1, 2, 3]])
    assert held and params["remote_request_id"] == "r-abc"
    meta = sched.build_connector_meta()
    assert set(meta.send) == {"r-abc"} and meta.release == set()
    # the release: an aborted request whose params name the held one; its own blocks are nothing to hold
    assert sched.request_finished(finished("r-abc-release", {RELEASE_KEY: "r-abc"}, "FINISHED_ABORTED"), []) \
        == (False, None)
    meta = sched.build_connector_meta()
    assert meta.release == {"r-abc"} and meta.send == {} and meta.abandon == {}
    assert sched.build_connector_meta().release == set()  # once
    assert sched.stats["released"] == 1
