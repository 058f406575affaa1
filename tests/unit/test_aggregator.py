"""KVOutputAggregator: per-rank outputs -> one verdict per step (no Ray, no vLLM)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.kv.aggregator import KVConnectorOutput, KVOutputAggregator
from actors.kv.transfer_errors import AggregationError, KVTransferError


def out(**kwargs) -> KVConnectorOutput:
    return KVConnectorOutput(**{k: set(v) if isinstance(v, (list, tuple)) else v
                                for k, v in kwargs.items()})


# -- KVConnectorOutput ------------------------------------------------------

def test_output_defaults_are_empty_and_independent():
    a, b = KVConnectorOutput(), KVConnectorOutput()
    assert a.is_empty()
    a.finished_sending.add("r1")
    assert b.finished_sending == set()  # no shared mutable default
    assert not a.is_empty()


@pytest.mark.parametrize("kwargs", [
    {"finished_recving": {"r"}}, {"invalid_block_ids": {3}}, {"failed_recving": {"r"}},
    {"stats": {"bytes": 1.0}}, {"kv_cache_events": object()},
])
def test_output_is_empty_false_for_any_content(kwargs):
    assert not KVConnectorOutput(**kwargs).is_empty()


def test_expected_count_alone_is_still_empty():
    assert KVConnectorOutput(expected_finished_count=4).is_empty()


# -- construction / validation ----------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_expected_count_rejected(bad):
    with pytest.raises(AggregationError):
        KVOutputAggregator(bad)


def test_aggregation_error_is_a_typed_value_error():
    with pytest.raises(ValueError):
        KVOutputAggregator(0)
    assert issubclass(AggregationError, KVTransferError)


@pytest.mark.parametrize("bad_output", [
    "not an output",
    KVConnectorOutput(expected_finished_count=-1),
    KVConnectorOutput(stats={"x": "fast"}),
    KVConnectorOutput(finished_sending=["r1"]),  # type: ignore[arg-type]
])
def test_malformed_output_rejected_without_touching_state(bad_output):
    agg = KVOutputAggregator(2)
    agg.aggregate([out(finished_sending=["a"]), None])
    before = agg.pending()
    with pytest.raises(AggregationError):
        # The good output must not be counted when its neighbour is malformed.
        agg.aggregate([out(finished_sending=["a"]), bad_output])
    assert agg.pending() == before
    assert agg.aggregate([out(finished_sending=["a"])]).finished_sending == {"a"}


# -- counting across ranks and steps ----------------------------------------

def test_single_rank_finishes_immediately():
    agg = KVOutputAggregator(1)
    result = agg.aggregate([out(finished_sending=["s"], finished_recving=["r"])])
    assert result.finished_sending == {"s"}
    assert result.finished_recving == {"r"}
    assert result.expected_finished_count == 1
    assert agg.pending().is_empty()


def test_finished_only_when_all_ranks_reported_across_calls():
    agg = KVOutputAggregator(3)
    r1 = agg.aggregate([out(finished_sending=["a"]), None, out(finished_sending=["a"])])
    assert r1.finished_sending == set()
    assert agg.pending().sending == {"a": 1}
    r2 = agg.aggregate([None, out(finished_sending=["a"]), None])
    assert r2.finished_sending == {"a"}
    assert agg.pending().sending == {}


def test_sending_and_recving_counted_separately():
    agg = KVOutputAggregator(2)
    r1 = agg.aggregate([out(finished_sending=["x"]), out(finished_recving=["x"])])
    assert r1.finished_sending == set() and r1.finished_recving == set()
    assert agg.pending().sending == {"x": 1}
    assert agg.pending().recving == {"x": 1}
    r2 = agg.aggregate([out(finished_recving=["x"]), None])
    assert r2.finished_recving == {"x"}
    assert r2.finished_sending == set()


def test_none_outputs_and_empty_list():
    agg = KVOutputAggregator(2)
    result = agg.aggregate([None, None])
    assert result.is_empty()
    assert agg.aggregate([]).is_empty()


# -- expected count changes ---------------------------------------------------

def test_rank_announcing_new_expected_count_applies_to_new_ids():
    agg = KVOutputAggregator(2)
    agg.aggregate([out(finished_recving=["old"])])  # "old" needs 1 more
    result = agg.aggregate([out(expected_finished_count=3, finished_recving=["new"])])
    assert result.expected_finished_count == 3
    assert agg.expected_finished_count == 3
    assert agg.pending().recving == {"old": 1, "new": 2}
    # "old" keeps the count it started with: one more report finishes it.
    assert agg.aggregate([out(finished_recving=["old"])]).finished_recving == {"old"}
    assert agg.aggregate([out(finished_recving=["new"]),
                          out(finished_recving=["new"])]).finished_recving == {"new"}


def test_expected_count_zero_means_no_opinion():
    agg = KVOutputAggregator(2)
    result = agg.aggregate([out(expected_finished_count=0, finished_sending=["a"])])
    assert result.expected_finished_count == 2
    assert agg.pending().sending == {"a": 1}


def test_expected_count_change_mid_batch_applies_to_later_outputs():
    agg = KVOutputAggregator(4)
    result = agg.aggregate([
        out(expected_finished_count=1, finished_sending=["a"]),
        out(finished_sending=["b"]),
    ])
    assert result.finished_sending == {"a", "b"}


# -- invalid blocks, failed receives, stats, events ---------------------------

def test_invalid_block_ids_are_unioned():
    agg = KVOutputAggregator(2)
    result = agg.aggregate([out(invalid_block_ids=[1, 2]), out(invalid_block_ids=[2, 7])])
    assert result.invalid_block_ids == {1, 2, 7}
    assert agg.aggregate([None, None]).invalid_block_ids == set()  # not sticky


def test_failed_recv_is_reported_together_with_its_finish():
    agg = KVOutputAggregator(2)
    r1 = agg.aggregate([out(failed_recving=["f"], finished_recving=["f"]), None])
    assert r1.failed_recving == set()
    assert r1.finished_recving == set()
    assert agg.pending().failed_recving == {"f"}
    r2 = agg.aggregate([None, out(finished_recving=["f"])])
    assert r2.finished_recving == {"f"}
    assert r2.failed_recving == {"f"}
    assert agg.pending().failed_recving == frozenset()
    # Reported once only.
    assert agg.aggregate([None, None]).failed_recving == set()


def test_failed_recv_does_not_taint_other_finishes():
    agg = KVOutputAggregator(1)
    agg.aggregate([out(failed_recving=["bad"])])
    result = agg.aggregate([out(finished_recving=["good"])])
    assert result.finished_recving == {"good"}
    assert result.failed_recving == set()
    assert agg.aggregate([out(finished_recving=["bad"])]).failed_recving == {"bad"}


def test_stats_are_summed_per_key():
    agg = KVOutputAggregator(2)
    result = agg.aggregate([
        out(stats={"bytes": 100.0, "reads": 2}),
        None,
        out(stats={"bytes": 50.5, "errors": 1}),
    ])
    assert result.stats == {"bytes": 150.5, "reads": 2, "errors": 1}


def test_kv_cache_events_collected_in_rank_order():
    agg = KVOutputAggregator(2)
    e0, e2 = object(), object()
    result = agg.aggregate([out(kv_cache_events=e0), out(), out(kv_cache_events=e2)])
    assert result.kv_cache_events == (e0, e2)
    assert agg.aggregate([out(), None]).kv_cache_events is None


# -- salvage after a rank failure --------------------------------------------

def test_salvaged_outputs_replayed_at_next_aggregate():
    agg = KVOutputAggregator(2)
    events = object()
    dead = out(finished_sending=["a"], invalid_block_ids=[9], stats={"bytes": 10.0},
               kv_cache_events=events)
    agg.ft_defer_kv_connector_outputs([dead, None])
    assert dead.kv_cache_events is None  # dropped on the stashed output itself, as the reference does
    assert agg.pending().salvaged_outputs == 1
    result = agg.aggregate([out(finished_sending=["a"])])
    assert result.finished_sending == {"a"}  # salvaged report counted
    assert result.invalid_block_ids == {9}
    assert result.stats == {"bytes": 10.0}
    assert result.kv_cache_events is None  # events of the dead rank dropped
    assert agg.pending().salvaged_outputs == 0
    # Replayed once only.
    assert agg.aggregate([out(finished_sending=["a"])]).finished_sending == set()


def test_salvaged_failed_recv_still_reported():
    agg = KVOutputAggregator(2)
    agg.ft_defer_kv_connector_outputs([out(failed_recving=["r"], finished_recving=["r"])])
    result = agg.aggregate([out(finished_recving=["r"]), None])
    assert result.finished_recving == {"r"}
    assert result.failed_recving == {"r"}


def test_from_connector_uses_the_connectors_finished_count():
    class Counting:
        def __init__(self, count):
            self.count = count

        def get_finished_count(self):
            return self.count

    assert KVOutputAggregator.from_connector(Counting(3), world_size=8).expected_finished_count == 3
    assert KVOutputAggregator.from_connector(Counting(None), world_size=8).expected_finished_count == 8
    assert KVOutputAggregator.from_connector(object(), world_size=2).expected_finished_count == 2


def test_defer_rejects_malformed():
    agg = KVOutputAggregator(1)
    with pytest.raises(AggregationError):
        agg.ft_defer_kv_connector_outputs([42])  # type: ignore[list-item]
    assert agg.pending().salvaged_outputs == 0


# -- forget ----------------------------------------------------------------------

def test_forget_drops_all_counters():
    agg = KVOutputAggregator(3)
    agg.aggregate([out(finished_sending=["a"], finished_recving=["a"], failed_recving=["a"]),
                   out(finished_sending=["b"])])
    assert agg.forget("a") is True
    pending = agg.pending()
    assert pending.sending == {"b": 2}
    assert pending.recving == {}
    assert pending.failed_recving == frozenset()
    assert agg.forget("a") is False
    assert agg.forget("never-seen") is False


def test_forget_scrubs_salvaged_outputs():
    agg = KVOutputAggregator(2)
    agg.ft_defer_kv_connector_outputs([out(finished_sending=["a", "b"], failed_recving=["a"])])
    assert agg.forget("a") is True
    agg.aggregate([None])
    assert agg.pending().sending == {"b": 1}  # "a" was not resurrected
    assert agg.pending().failed_recving == frozenset()


# -- properties ------------------------------------------------------------------

@st.composite
def interleavings(draw):
    """N ranks each report every id once; reports are cut into random steps,
    some of them deferred (rank failure) instead of aggregated."""
    n_ranks = draw(st.integers(1, 4))
    ids = draw(st.lists(st.text("abcdef", min_size=1, max_size=3), min_size=1, max_size=6,
                        unique=True))
    reports = [(rank, req_id) for rank in range(n_ranks) for req_id in ids]
    reports = draw(st.permutations(reports))
    cuts = sorted(draw(st.lists(st.integers(0, len(reports)), max_size=8)))
    steps, start = [], 0
    for cut in [*cuts, len(reports)]:
        steps.append(reports[start:cut])
        start = cut
    deferred = draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps)))
    return n_ranks, ids, steps, deferred


@settings(max_examples=200, deadline=None)
@given(interleavings(), st.sampled_from(["sending", "recving"]))
def test_each_id_finishes_exactly_once_after_exactly_n_reports(case, direction):
    n_ranks, ids, steps, deferred = case
    agg = KVOutputAggregator(n_ranks)
    field = f"finished_{direction}"
    reported: dict[str, int] = {}
    seen: dict[str, int] = {}
    buffered: dict[str, int] = {}  # reports deferred but not yet replayed

    for step, defer in zip(steps, deferred):
        per_rank = [KVConnectorOutput() for _ in range(n_ranks)]
        for rank, req_id in step:
            getattr(per_rank[rank], field).add(req_id)
        if defer:
            agg.ft_defer_kv_connector_outputs(per_rank)
            for _, req_id in step:
                buffered[req_id] = buffered.get(req_id, 0) + 1
            continue
        for req_id, count in buffered.items():
            seen[req_id] = seen.get(req_id, 0) + count
        buffered.clear()
        for _, req_id in step:
            seen[req_id] = seen.get(req_id, 0) + 1
        for req_id in getattr(agg.aggregate(per_rank), field):
            reported[req_id] = reported.get(req_id, 0) + 1
            # Reported in the very step that brought its N-th report.
            assert seen[req_id] == n_ranks
        for req_id in ids:
            if seen.get(req_id, 0) < n_ranks:
                assert req_id not in reported

    # Flush anything still deferred.
    for req_id in getattr(agg.aggregate([]), field):
        reported[req_id] = reported.get(req_id, 0) + 1
    assert reported == {req_id: 1 for req_id in ids}
    assert agg.pending().is_empty()


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.lists(st.sampled_from("abcd"), max_size=20))
def test_failed_recv_reported_exactly_when_its_recv_finishes(n_ranks, failing):
    agg = KVOutputAggregator(n_ranks)
    failing_set = set(failing)
    for req_id in failing:
        agg.aggregate([out(failed_recving=[req_id])])
    got_failed: set[str] = set()
    for rank in range(n_ranks):
        result = agg.aggregate([out(finished_recving=list("abcd"))])
        got_failed |= result.failed_recving
        if rank < n_ranks - 1:
            assert result.failed_recving == set()
        else:
            assert result.finished_recving == set("abcd")
    assert got_failed == failing_set
    assert agg.pending().is_empty()


# -- the reference's semantics, step by step ------------------------------------------

class ReferenceAggregator:
    """The customer's reference aggregate(), restated over plain per-rank outputs (test oracle)."""

    def __init__(self, expected):
        self.expected, self.send, self.recv, self.failed_pending, self.salvaged = expected, {}, {}, set(), []

    def aggregate(self, outputs):
        sending, recving, invalid = set(), set(), set()
        salvaged, self.salvaged = self.salvaged, []
        for o in [*salvaged, *outputs]:
            if o is None:
                continue
            if o.expected_finished_count > 0 and o.expected_finished_count != self.expected:
                self.expected = o.expected_finished_count
            for ids, remaining, finished in ((o.finished_sending, self.send, sending),
                                             (o.finished_recving, self.recv, recving)):
                for req_id in ids:
                    remaining[req_id] = remaining.get(req_id, self.expected) - 1
                    if remaining[req_id] == 0:
                        finished.add(req_id)
                        del remaining[req_id]
            invalid |= o.invalid_block_ids
            self.failed_pending |= o.failed_recving
        failed = self.failed_pending & recving
        self.failed_pending -= failed
        return sending, recving, invalid, failed, self.expected

    def defer(self, outputs):
        self.salvaged.extend(o for o in outputs if o)


@st.composite
def rank_steps(draw):
    n = draw(st.integers(1, 3))
    ids = st.sets(st.sampled_from("abc"), max_size=2)
    rank = st.builds(lambda s, r, i, f, e: out(finished_sending=s, finished_recving=r, invalid_block_ids=i,
                                               failed_recving=f, expected_finished_count=e),
                     ids, ids, st.sets(st.integers(0, 5), max_size=2), ids, st.sampled_from([0, 0, 0, 1, 2, 3]))
    steps = draw(st.lists(st.tuples(st.lists(st.one_of(st.none(), rank), min_size=n, max_size=n),
                                    st.booleans()), max_size=12))
    return n, steps


@settings(max_examples=300, deadline=None)
@given(rank_steps())
def test_every_step_matches_the_reference(case):
    n, steps = case
    ours, ref = KVOutputAggregator(n), ReferenceAggregator(n)
    for outputs, failed_rank in steps:
        if failed_rank:  # a worker died: its outputs are stashed for the next step
            ours.ft_defer_kv_connector_outputs([o and out(**vars(o)) for o in outputs])
            ref.defer(outputs)
            continue
        got = ours.aggregate([o and out(**vars(o)) for o in outputs])
        assert (got.finished_sending, got.finished_recving, got.invalid_block_ids, got.failed_recving,
                got.expected_finished_count) == ref.aggregate(outputs)
