"""The SLO planner's shortlist at cluster size: the least loaded engines and those holding the prompt."""

from serving.routing.shortlist import SHORTLIST, shortlist


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


class _Load:
    def __init__(self, requests, tokens=0):
        self.requests, self.tokens = requests, tokens


class _Pool:
    def __init__(self, loads):
        self.prefills = dict.fromkeys(loads)
        self.prefill_load = {p: _Load(r) for p, r in loads.items()}

    def prefill_order(self, p):
        x = self.prefill_load[p]
        return x.requests, x.tokens

    def prefill_keys(self, ids):
        return [self.prefill_order(p) for p in ids]


def test_one_ranking_gives_each_decode_engine_the_shortlist_of_its_own_prefill_engines():
    """The walk down one load ranking equals `shortlist` over each decode engine's usable prefill engines,
    also for one whose pairs with the least loaded engines are not usable (open breakers)."""
    from serving.routing.shortlist import PrefillShortlist

    loads = {f"p{i}": (i * 7) % 12 for i in range(12)}  # p0 idle, then p7, p2, p9, ...
    pool = _Pool(loads)
    cached = {"p4": 64, "p9": 32, "d0": 64}
    short = PrefillShortlist(pool, cached, k=2)
    every = list(loads)
    without_idle = [p for p in every if p not in ("p0", "p7", "p9")]
    for usable in (every, without_idle, every[:2]):
        assert short.of(usable) == shortlist(usable, cached, pool.prefill_order, k=2)
    assert short.of(every) == ["p0", "p4", "p7", "p9"]
