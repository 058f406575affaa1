"""A request's decode charge (pure): the load it owes its decode engine and its freshness, until its
second token, which the SLO placer reads as `EngineEstimate.fresh_streams`."""

from __future__ import annotations

from serving.placement_config import PlacementConfig
from serving.routing.placers import EngineEstimates
from serving.routing.pool import DecodeCharge, EnginePool, Load


class _Engine:  # the pool only keeps it; placement reads the pool's loads and rates
    pass


def test_a_request_is_fresh_until_its_second_token():
    load = Load()
    charge = DecodeCharge(load, 70)
    assert (load.requests, load.tokens, load.fresh) == (1, 70, 1)
    charge.pay(1)
    assert load.fresh == 1
    charge.pay(1)
    assert (load.tokens, load.fresh) == (68, 0)
    charge.settle()
    assert (load.requests, load.tokens, load.fresh) == (0, 0, 0)


def test_a_chunk_of_several_tokens_ends_freshness_once_and_settling_twice_refunds_once():
    load = Load()
    charge = DecodeCharge(load, 10)
    charge.pay(3)
    charge.pay(3)
    charge.settle()
    charge.settle()
    assert (load.requests, load.tokens, load.fresh) == (0, 0, 0)


def test_a_request_ended_before_its_second_token_gives_its_freshness_back():
    load = Load()
    with DecodeCharge(load, 10) as charge:
        charge.pay(1)
    assert (load.requests, load.tokens, load.fresh) == (0, 0, 0)


def test_the_slo_placer_sees_the_fresh_streams_the_pool_charged():
    pool = EnginePool({}, {"d0": _Engine(), "d1": _Engine()})
    fresh = pool.charge_decode("d0", 64)
    old = pool.charge_decode("d1", 64)
    old.pay(2)
    estimates = EngineEstimates(PlacementConfig())
    assert [estimates.of(pool, d).fresh_streams for d in ("d0", "d1")] == [1, 0]
    fresh.settle()
    old.settle()
    assert estimates.of(pool, "d0").fresh_streams == 0
