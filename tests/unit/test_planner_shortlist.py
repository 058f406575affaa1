"""The SLO planner's shortlist at cluster size: the least loaded engines and those holding the prompt."""

from serving.routing.planner import SHORTLIST, shortlist


def test_a_small_deployment_is_considered_whole():
    ids = [f"e{i}" for i in range(SHORTLIST)]
    assert shortlist(ids, {}, lambda e: 0) == ids


def test_the_least_loaded_and_the_cache_holders_are_kept_in_the_given_order():
    ids = [f"e{i}" for i in range(12)]
    load = {e: 12 - i for i, e in enumerate(ids)}  # e11 is the least loaded
    cached = {"e0": 64, "e3": 16}  # the busiest engines hold the prompt
    assert shortlist(ids, cached, load.__getitem__, k=2) == ["e0", "e3", "e10", "e11"]


def test_without_a_load_key_the_list_is_taken_as_least_loaded_first():
    ids = [f"p{i}" for i in range(10)]
    assert shortlist(ids, {"p7": 32}, k=3) == ["p0", "p1", "p2", "p7"]


def test_ties_keep_the_callers_rotation():
    ids = ["c", "a", "b", "d", "e"]
    assert shortlist(ids, {}, lambda e: 0, k=2) == ["c", "a"]
