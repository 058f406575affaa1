"""Exact leases on vLLM: the EngineActor stops counting a prefill as held when the engine reports
its lease ended (the readers' notices, an expiry, a release), not when its TTL passes here.

The report's way, with vLLM's own pieces and fakes (no engine started): each worker's step says
which leases it let expire or dropped for the release list (`LeaseEnds`, vLLM's worker metadata,
united over the ranks by vLLM's `KVOutputAggregator`); the scheduler half names how every lease
vLLM reports finished sending ended (`LeaseEndStats`, vLLM's connector stats); vLLM carries those
to the client in the step's `SchedulerStats`, where the backend's stat logger ends the entries.
"""

from __future__ import annotations

import asyncio
import shutil
from types import SimpleNamespace

import pytest

from actors.engine.vllm.leases import UnreadLeases, lease_ends_logger

pytest.importorskip("vllm")

from actors.engine.vllm.connector.metadata import LeaseEnds, LeaseEndStats  # noqa: E402
from actors.engine.vllm.connector.scheduler import RELEASE_KEY, ConnectorScheduler  # noqa: E402
from actors.engine.vllm.connector.worker import ConnectorWorker  # noqa: E402
from actors.kv.plan.pull_types import StepResult  # noqa: E402

TTL_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def held(clock: Clock | None = None) -> tuple[UnreadLeases, dict]:
    counters = {"released": 0}
    return UnreadLeases(counters, clock or Clock()), counters


# ------------------------------------------------------------------ the actor's bookkeeping
def test_a_readers_notice_ends_the_held_lease_at_once_not_at_its_ttl():
    clock = Clock()
    unread, counters = held(clock)
    unread.remember("r1", "r1-v", TTL_S)
    unread.remember("r2", "r2-v", TTL_S)
    assert len(unread) == 2
    clock.now += 0.5  # well before the TTL
    unread.ended({"read": ["r1-v"]})
    assert len(unread) == 1 and counters["leases_released_by_notice"] == 1 and counters["leases_expired"] == 0
    unread.ended({"read": ["r2-v"]})
    assert len(unread) == 0 and counters["leases_released_by_notice"] == 2


def test_an_expiry_report_ends_it_and_counts_as_expired():
    unread, counters = held()
    unread.remember("r1", "r1-v", TTL_S)
    unread.ended({"expired": ["r1-v"]})
    assert len(unread) == 0 and (counters["leases_expired"], counters["leases_released_by_notice"]) == (1, 0)


def test_the_ttl_still_bounds_a_lease_the_engine_never_reports():
    clock = Clock()
    unread, counters = held(clock)
    unread.remember("r1", "r1-v", TTL_S)
    clock.now += TTL_S - 0.01
    assert len(unread) == 1
    clock.now += 0.02
    assert len(unread) == 0  # the backstop: an engine core that died holding it says nothing
    assert counters["leases_expired"] == counters["leases_released_by_notice"] == 0  # reports only
    unread.ended({"expired": ["r1-v"]})  # a report after the backstop still counts, once
    assert counters["leases_expired"] == 1 and len(unread) == 0


def test_an_abort_pops_the_entry_and_the_release_report_only_confirms():
    unread, counters = held()
    unread.remember("r1", "r1-v", TTL_S)
    assert unread.pop("r1") == "r1-v" and unread.pop("r1") is None and len(unread) == 0
    unread.ended({"released": ["r1-v"]})
    assert (counters["leases_expired"], counters["leases_released_by_notice"]) == (0, 0)


def test_a_reused_request_id_replaces_its_entry_and_unknown_ids_touch_nothing_held():
    unread, counters = held()
    unread.remember("r1", "old-v", TTL_S)
    unread.remember("r1", "new-v", TTL_S)
    unread.ended({"read": ["old-v", "someone-else"]})
    assert len(unread) == 1 and counters["leases_released_by_notice"] == 2  # counted: the engine said so
    unread.ended({"read": ["new-v"]})
    assert len(unread) == 0


def test_the_stat_logger_hands_over_lease_ends_and_ignores_other_stats():
    seen = []
    logger = lease_ends_logger(seen.append)(SimpleNamespace(), 0)
    logger.record(None, None)
    logger.record(SimpleNamespace(kv_connector_stats=None), None)
    logger.record(SimpleNamespace(kv_connector_stats={"num_successful_transfers": 3}), None)  # not ours
    logger.record(SimpleNamespace(kv_connector_stats={"read": [], "expired": []}), None)
    logger.record(SimpleNamespace(kv_connector_stats={"read": ["a"]}), None)
    assert seen == [{"read": ["a"]}]


def test_a_failure_applying_lease_ends_never_reaches_vllms_output_handler():
    def broken(report):
        raise KeyError("boom")

    lease_ends_logger(broken)(SimpleNamespace(), 0).record(SimpleNamespace(kv_connector_stats={"read": ["a"]}), None)


# ------------------------------------------------------------------ the connector's halves
def finished(req_id, params, status="FINISHED_LENGTH_CAPPED"):
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, status=SimpleNamespace(name=status),
                           num_computed_tokens=40)


def producer() -> ConnectorScheduler:
    sched = ConnectorScheduler("P", tp_size=1, pp_size=1, dcp_size=1, block_size=16, lease_ttl_s=TTL_S,
                               clock=lambda: 0.0)
    for req_id in ("r-read", "r-exp", "r-rel"):
        assert sched.request_finished(finished(req_id, {"do_remote_decode": True}), [[1, 2, 3]])[0]
    sched.build_connector_meta()
    return sched


def output(sending=(), meta=None):
    return SimpleNamespace(finished_sending=set(sending) or None, kv_connector_worker_meta=meta,
                           invalid_block_ids=set())


def test_the_scheduler_half_names_how_each_lease_vllm_frees_ended():
    sched = producer()
    assert sched.lease_ends() is None  # nothing ended yet: no stats this step
    sched.update_connector_output(output({"r-read", "r-exp", "r-rel"},
                                         LeaseEnds(expired=frozenset({"r-exp"}), released=frozenset({"r-rel"}))))
    ends = sched.lease_ends()
    assert {k: sorted(v) for k, v in ends.to_dict().items()} == {
        "read": ["r-read"], "expired": ["r-exp"], "released": ["r-rel"]}
    assert sched.lease_ends() is None  # each end is reported once
    assert (sched.stats["leases_read"], sched.stats["leases_expired"], sched.stats["leases_released"]) == (1, 1, 1)


def test_a_rank_that_expired_before_the_others_finished_makes_the_lease_expired():
    sched = producer()
    # TP 2: rank 1 let it expire this step; vLLM reports it finished once rank 0 ends it too
    sched.update_connector_output(output((), LeaseEnds(expired=frozenset({"r-exp"}))))
    assert sched.lease_ends() is None
    sched.update_connector_output(output({"r-exp", "r-read"}))
    assert sched.lease_ends().to_dict() == {"expired": ["r-exp"], "read": ["r-read"]}


def test_release_requests_still_reach_the_workers():
    sched = producer()
    sched.request_finished(finished("r-rel-release", {RELEASE_KEY: "r-rel"}, "FINISHED_ABORTED"), [])
    assert sched.build_connector_meta().release == {"r-rel"}


class FakeXfer:
    def __init__(self, step: StepResult, holding: set[str]):
        self._step, self.holding = step, holding

    def release(self, req_id):
        return [7] if self.holding and req_id in self.holding else []

    def step(self):
        step, self._step = self._step, StepResult()
        return step


def rank(step: StepResult, holding=()) -> ConnectorWorker:
    w = ConnectorWorker.__new__(ConnectorWorker)
    w._load_errors, w._stepped, w._sync_ids, w._expired, w._dropped, w._failed = set(), [], set(), set(), set(), {}
    w.xfer = FakeXfer(step, set(holding))
    return w


def test_a_worker_says_which_leases_it_let_expire_or_dropped_for_the_release_list():
    from actors.engine.vllm.connector.metadata import RayNixlMetadata

    w = rank(StepResult(released=("r-read", "r-rel"), expired=("r-exp",)), holding={"r-rel"})
    w.start_load_kv(RayNixlMetadata(release={"r-rel", "r-gone"}))  # r-gone's lease had ended already
    sending, _, _ = w.get_transfer_results()
    assert sending == {"r-read", "r-rel", "r-exp"}
    assert w.worker_meta() == LeaseEnds(expired=frozenset({"r-exp"}), released=frozenset({"r-rel"}))
    assert w.worker_meta() is None  # once; a step where every lease ended by notices says nothing


def test_the_ranks_reports_unite():
    a = LeaseEnds(expired=frozenset({"x"}))
    b = LeaseEnds(expired=frozenset({"y"}), released=frozenset({"z"}))
    assert a.aggregate(b) == LeaseEnds(frozenset({"x", "y"}), frozenset({"z"}))


def test_lease_end_stats_aggregate_and_reduce_for_vllms_logging_stat_logger():
    from actors.engine.vllm.connector.connector import RayNixlConnector

    stats = RayNixlConnector.build_kv_connector_stats({"read": ["a"]})
    merged = stats.aggregate(LeaseEndStats({"read": ["b"], "expired": ["c"]}))
    assert merged.reduce() == {"leases_read": 2, "leases_expired": 1, "leases_released": 0, "pulls_failed": 0}
    assert LeaseEndStats().is_empty() and LeaseEndStats({"read": []}).is_empty() and not merged.is_empty()


# ------------------------------------------------------------------ the whole way, with vLLM's pieces
def test_a_notice_on_every_rank_reaches_the_actor_through_vllms_own_outputs():
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    clock = Clock()
    unread, counters = held(clock)
    for req_id in ("read", "exp"):
        unread.remember(req_id, f"r-{req_id}", TTL_S)
    sched = producer()
    logger = lease_ends_logger(unread.ended)(SimpleNamespace(), 0)
    aggregator = KVOutputAggregator(2)  # TP 2: vLLM merges the two workers' outputs

    def step(*ranks: tuple[set[str], LeaseEnds | None]) -> None:
        outs = [ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
            finished_sending=sending or None, kv_connector_worker_meta=meta)) for sending, meta in ranks]
        sched.update_connector_output(aggregator.aggregate(outs).kv_connector_output)
        ends = sched.lease_ends()  # what vLLM's scheduler puts in the step's SchedulerStats
        stats = SchedulerStats(kv_connector_stats=ends.to_dict() if ends else None)
        wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))  # engine core -> client
        logger.record(MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats, None)

    step(({"r-read"}, None), (set(), None))  # rank 0's reader notified; rank 1's not yet
    assert len(unread) == 2
    step((set(), None), ({"r-read"}, None))  # the last reader's notice
    assert len(unread) == 1 and counters["leases_released_by_notice"] == 1
    clock.now += TTL_S / 2  # the other one expires on one rank, ends by notice on the other
    step(({"r-exp"}, LeaseEnds(expired=frozenset({"r-exp"}))), ({"r-exp"}, None))
    assert len(unread) == 0 and (counters["leases_released_by_notice"], counters["leases_expired"]) == (1, 1)


def test_the_backend_wires_the_lease_ends_into_held_leases():
    from actors.engine.config import EngineConfig
    from actors.engine.vllm.backend import VllmBackend

    backend = VllmBackend(EngineConfig(role="prefill"), "p0")
    try:
        assert backend.counters["leases_released_by_notice"] == backend.counters["leases_expired"] == 0
        backend._unread.remember("r1", "r1-v", TTL_S)
        assert asyncio.run(backend.stats()).held_leases == 1
        # raypd's own two sinks (vLLM's Prometheus logger joins them when Ray is initialized in this
        # process, as after the integration tests in one pytest run; it needs a whole VllmConfig)
        loggers = [factory(SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=8)), 0)
                   for factory in backend._stat_loggers()[:2]]
        for logger in loggers:
            logger.record(SimpleNamespace(kv_connector_stats={"read": ["r1-v"]}, kv_cache_usage=0.0,
                                          num_running_reqs=0, num_waiting_reqs=0), None)
        stats = asyncio.run(backend.stats())
        assert stats.held_leases == 0 and stats.counters["leases_released_by_notice"] == 1
    finally:
        shutil.rmtree(backend.handshake_dir, ignore_errors=True)


# ------------------------------------------------------------------ failed pulls, with the ranks' reasons
def test_a_failed_pulls_reason_reaches_the_actor_counted_by_kind_and_kept_for_the_request():
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from actors.kv.plan.pull_types import LEASE_ENDED, NO_LEASE_RECORD

    unread, counters = held()
    logger = lease_ends_logger(unread.ended)(SimpleNamespace(), 0)
    sched = ConnectorScheduler("D", tp_size=2, pp_size=1, dcp_size=1, block_size=16, lease_ttl_s=TTL_S)
    aggregator = KVOutputAggregator(2)
    late = "late-d-0123abcd"  # vLLM's id: the request's plus a random suffix
    ranks = [rank(StepResult(failed={late: LEASE_ENDED}, invalid_block_ids={late: (3, 4)})),
             rank(StepResult(failed={late: LEASE_ENDED, "slow-9f8e7d6c": f"{NO_LEASE_RECORD} 10.0s"}))]
    for w in ranks:
        w.get_transfer_results()
    assert ranks[0].get_block_ids_with_load_errors() == {3, 4}
    assert ranks[0].worker_meta() == LeaseEnds(failed_pulls=((late, LEASE_ENDED),))
    ranks[0]._failed = {late: LEASE_ENDED}  # as before the call: both ranks report in one step
    outs = [ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
        invalid_block_ids={3, 4}, kv_connector_worker_meta=w.worker_meta())) for w in ranks]
    sched.update_connector_output(aggregator.aggregate(outs).kv_connector_output)
    ends = sched.lease_ends()
    assert ends.reduce()["pulls_failed"] == 2  # one per request, though both ranks failed the late one
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=ends.to_dict())))
    logger.record(MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats, None)
    assert counters["pull_failures_lease_ended"] == 1 and counters["pull_failures_no_lease_record"] == 1
    assert counters["pull_failures_integrity"] == counters["pull_failures_transfer"] == 0
    assert unread.pull_failures.reason("late-d") == LEASE_ENDED  # by the caller's id, as the decode path asks
    assert unread.pull_failures.reason("slow").startswith(NO_LEASE_RECORD)
    assert unread.pull_failures.reason("other") is None and sched.lease_ends() is None


def test_failed_pulls_are_exported_by_kind_as_a_prometheus_counter():
    from prometheus_client import Counter, Gauge, Histogram

    from actors.engine.vllm.connector.connector import RayNixlConnector
    from actors.kv.plan.pull_types import LEASE_ENDED

    class FakeCounter:
        made: list = []

        def __init__(self, name, documentation="", labelnames=None):
            self.name, self.labelnames, self.values, self.n = name, labelnames, None, 0
            FakeCounter.made.append(self)

        def labels(self, *values):
            child = FakeCounter(self.name, labelnames=self.labelnames)
            child.values = values
            return child

        def inc(self, n=1):
            self.n += n

    prom = RayNixlConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None),
                                               {Gauge: None, Counter: FakeCounter, Histogram: None},
                                               ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"read": ["x"], "pull_failed": [["late-d-0123abcd", LEASE_ENDED], ["b-1", "boom"]]}, 0)
    counts = {c.values[-1]: c.n for c in FakeCounter.made if c.values}
    assert FakeCounter.made[0].name == "vllm:raypd_kv_pull_failures"
    assert FakeCounter.made[0].labelnames == ["model_name", "engine", "reason"]
    assert counts == {"lease_ended": 1, "no_lease_record": 0, "integrity": 0, "transfer": 1}
