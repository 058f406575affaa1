"""Scaling advice from the placement model: which pool grows or shrinks, and why."""

from __future__ import annotations

from serving.routing.placement import EngineEstimate
from serving.routing.pool_pressure import LoadMix, pool_pressure


def engine(engine_id: str, role: str) -> EngineEstimate:
    # CPU-like: 400 prompt tokens/s, a 50 ms step, +1 ms per stream
    return EngineEstimate(engine_id, role, prefill_tokens_per_s=400.0, decode_step_s=0.05, step_per_stream_s=0.001)


P, D, D2 = engine("p", "prefill"), engine("d", "decode"), engine("d2", "decode")


def test_long_prompts_at_a_high_rate_grow_the_prefill_pool():
    a = pool_pressure([P, D], 0.3, LoadMix(prompt_tokens=1024, output_tokens=64))
    assert (a.role, a.delta, a.reason) == ("prefill", +1, "ttft")


def test_long_answers_grow_the_decode_pool():
    a = pool_pressure([P, D], 0.45, LoadMix(prompt_tokens=64, output_tokens=2000))
    assert (a.role, a.delta, a.reason) == ("decode", +1, "itl")


def test_an_idle_decode_pool_shrinks_by_one():
    a = pool_pressure([P, D, D2], 0.01, LoadMix(prompt_tokens=128, output_tokens=64))
    assert (a.role, a.delta, a.reason) == ("decode", -1, "idle")


def test_both_engines_are_scaled_as_one_count_when_their_itl_suffers():
    a = pool_pressure([engine("e1", "both"), engine("e2", "both")], 0.7, LoadMix(1024, 64))
    assert (a.role, a.delta, a.reason) == ("both", +1, "itl")


def test_idle_both_engines_shrink():
    a = pool_pressure([engine(f"e{i}", "both") for i in range(3)], 0.01, LoadMix(128, 64))
    assert (a.role, a.delta) == ("both", -1)


def test_a_pool_that_would_miss_with_one_engine_fewer_holds():
    a = pool_pressure([engine("e1", "both"), engine("e2", "both")], 0.5, LoadMix(1024, 64))
    assert (a.role, a.delta, a.reason) == (None, 0, "steady")


def test_no_engines_no_advice():
    assert pool_pressure([], 1.0, LoadMix(128, 64)).reason == "no_engines"
