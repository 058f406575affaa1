"""Engine scores (cached prefix vs load) and placement `disaggregate`'s decision, with its reasons."""

from __future__ import annotations

from serving.routing.policy import Candidate, ScoreSettings, decide_prefill, rank

SETTINGS = ScoreSettings(cache_weight=1.0)


def ids(cands):
    return [c.engine_id for c in cands]


def test_the_engine_holding_the_prefix_wins_at_equal_load():
    cands = [Candidate("d0", cached_tokens=0, load_tokens=100), Candidate("d1", cached_tokens=900, load_tokens=100)]
    assert ids(rank(cands, 1000, 1.0)) == ["d1", "d0"]


def test_load_outweighs_a_cache_hit_worth_less_than_the_load_difference():
    cands = [Candidate("d0", cached_tokens=0, load_tokens=0), Candidate("d1", cached_tokens=500, load_tokens=800)]
    assert ids(rank(cands, 1000, 1.0)) == ["d0", "d1"]  # 1000 vs 500 + 800
    assert ids(rank(cands, 1000, 2.0)) == ["d1", "d0"]  # 2000 vs 1000 + 800: the knob follows the cache


def test_cache_weight_zero_routes_by_load_and_ties_rotate():
    cands = [Candidate("d0", cached_tokens=900), Candidate("d1")]
    assert [ids(rank(cands, 1000, 0.0, turn=t))[0] for t in range(4)] == ["d0", "d1", "d0", "d1"]


def test_fewer_requests_break_a_cost_tie():
    cands = [Candidate("d0", requests=3), Candidate("d1", requests=1)]
    assert ids(rank(cands, 10, 1.0)) == ["d1", "d0"]


def test_a_usable_prefill_engine_always_prefills_under_disaggregate():
    d = decide_prefill(Candidate("p0", load_tokens=10**6))
    assert (d.decision, d.reason, d.remote) == ("remote", "uncached_prompt", True)


def test_no_prefill_engine_means_local_or_reject_per_the_fallback():
    assert decide_prefill(None).decision == "local"
    d = decide_prefill(None, fallback_local=False)
    assert (d.decision, d.reason) == ("reject", "no_prefill_engine")


def test_select_picks_the_caching_decode_engine_then_ranks_its_prefills_and_decides():
    from serving.routing.policy import select

    decodes = [Candidate("d0", load_tokens=50), Candidate("d1", cached_tokens=980, load_tokens=60)]
    prefills = {"d1": [Candidate("p0", load_tokens=3000), Candidate("p1", cached_tokens=500)]}
    sel = select(1000, decodes, lambda d: prefills.get(d, []), SETTINGS)
    assert (sel.decode.engine_id, [p.engine_id for p in sel.prefills]) == ("d1", ["p1", "p0"])
    assert (sel.decision.decision, sel.decision.reason) == ("remote", "uncached_prompt")
    assert select(1000, [], lambda d: [], SETTINGS) is None
