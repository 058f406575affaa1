"""Scaling advice from the planner's simulation of the live pools: which pool grows or shrinks, and why."""

from __future__ import annotations

from serving.sizing.live import LivePool, LoadMix, scale_advice
from serving.routing.slo_model import EngineEstimate


def pool(role: str, n: int, per_stream_s: float = 0.001, **bounds) -> LivePool:
    # CPU-like: 400 prompt tokens/s, a 50 ms step, + per_stream_s per stream
    return LivePool(role, tuple(EngineEstimate(f"{role}{i}", role, prefill_tokens_per_s=400.0, decode_step_s=0.05,
                                               step_per_stream_s=per_stream_s) for i in range(n)), **bounds)


def test_long_prompts_at_a_high_rate_grow_the_prefill_pool():
    a = scale_advice([pool("prefill", 1), pool("decode", 1)], 0.3, LoadMix(prompt_tokens=1024, output_tokens=64))
    assert (a.role, a.delta, a.reason) == ("prefill", +1, "ttft")


def test_long_answers_on_a_batch_sensitive_engine_grow_the_decode_pool():
    a = scale_advice([pool("prefill", 1, 0.004), pool("decode", 1, 0.004)], 0.45, LoadMix(64, 2000))
    assert (a.role, a.delta, a.reason) == ("decode", +1, "itl")


def test_an_idle_decode_pool_shrinks_by_one():
    a = scale_advice([pool("prefill", 1), pool("decode", 2)], 0.01, LoadMix(prompt_tokens=128, output_tokens=64))
    assert (a.role, a.delta, a.reason) == ("decode", -1, "idle")


def test_role_flexible_engines_behind_their_prompts_grow_in_number():
    a = scale_advice([pool("both", 2)], 0.7, LoadMix(1024, 64))
    assert (a.role, a.delta) == ("both", +1)


def test_idle_both_engines_shrink():
    a = scale_advice([pool("both", 3)], 0.01, LoadMix(128, 64))
    assert (a.role, a.delta) == ("both", -1)


def test_a_pool_that_would_miss_with_one_engine_fewer_holds():
    a = scale_advice([pool("both", 2)], 0.2, LoadMix(1024, 64))
    assert (a.role, a.delta, a.reason, dict((r, d) for r, d, o in a.candidates if o.pressure > 1)) == \
        (None, 0, "steady", {"both": -1})


def test_a_pool_at_its_bound_is_not_grown_and_an_engine_that_would_not_help_is_not_started():
    # the prefill pool is behind (as in the first test) but at its maximum; one more decode engine
    # would not shorten the prefill queue
    a = scale_advice([pool("prefill", 1, can_grow=False), pool("decode", 1)], 0.3, LoadMix(1024, 64))
    assert (a.role, a.delta, a.reason) == (None, 0, "no_relief")


def test_decode_engines_without_a_prefill_pool_are_simulated_prefilling_their_own_prompts():
    a = scale_advice([pool("decode", 2)], 0.7, LoadMix(1024, 64))
    assert (a.role, a.delta) == ("decode", +1)


def test_no_engines_no_advice():
    assert scale_advice([], 1.0, LoadMix(128, 64)).reason == "no_engines"
