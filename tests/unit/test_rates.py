"""Online rate estimates (pure, injected clock): priors first, then what the engines measure."""

from __future__ import annotations

import math
import random

import pytest

from serving.placement_config import PlacementConfig
from serving.routing.placement import Option, place
from serving.routing.rates import RateEstimator

# what the engine "really" does: a 20 ms step, +2 ms per stream, 1000 prompt tokens/s
A, B, C = 0.02, 0.002, 1 / 1000


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def feed(est: RateEstimator, clock: Clock, engine_id: str = "e", n: int = 200, a: float = A, b: float = B,
         c: float = C, seed: int = 1) -> None:
    """Inter-token gaps and prefill times of one engine, as its stats would report them."""
    rng = random.Random(seed)
    for i in range(n):
        clock.t += 0.5
        batch = rng.randint(0, 16)
        if i % 3 == 0:
            tokens = rng.randint(32, 1024)
            est.observe_prefill(engine_id, tokens, a + b * batch + c * tokens, batch)
        else:
            est.observe_gap(engine_id, a + b * batch, batch)


def test_priors_until_the_first_sample():
    cfg = PlacementConfig(prior_prefill_tokens_per_s=300.0, prior_step_s=0.04)
    r = RateEstimator(cfg, clock=Clock()).rates("e")
    assert (r.prefill_tokens_per_s, r.step_s, r.samples) == (pytest.approx(300.0), pytest.approx(0.04), 0.0)


def test_rates_converge_from_the_priors_to_the_measured_ones():
    clock = Clock()
    est = RateEstimator(clock=clock)
    feed(est, clock)
    r = est.rates("e")
    assert (r.prefill_tokens_per_s, r.step_s, r.step_per_stream_s) == (
        pytest.approx(1000, rel=0.02), pytest.approx(A, rel=0.05), pytest.approx(B, rel=0.05))


def test_a_few_samples_already_move_the_estimate_most_of_the_way():
    clock = Clock()
    est = RateEstimator(clock=clock)  # prior 400 tokens/s, true 1000
    feed(est, clock, n=10)
    assert est.rates("e").prefill_tokens_per_s > 900


def test_the_estimate_follows_an_engine_that_slows_down():
    clock = Clock()
    est = RateEstimator(PlacementConfig(rate_half_life_s=10.0), clock=clock)
    feed(est, clock)
    feed(est, clock, c=2 / 1000, seed=2)  # 100 s later: half the prefill rate
    assert est.rates("e").prefill_tokens_per_s == pytest.approx(500, rel=0.05)


def test_a_new_engine_starts_from_what_the_others_measured():
    clock = Clock()
    est = RateEstimator(clock=clock)
    feed(est, clock)
    assert est.rates("new").prefill_tokens_per_s == pytest.approx(1000, rel=0.1)


def test_what_was_learned_survives_an_idle_hour():
    clock = Clock()
    est = RateEstimator(clock=clock)
    feed(est, clock)
    clock.t += 3600
    assert est.rates("e").prefill_tokens_per_s == pytest.approx(1000, rel=0.1)


def test_transfer_rates_are_learned_per_pair_and_pooled_for_new_pairs():
    clock = Clock()
    est = RateEstimator(clock=clock)
    for i in range(100):
        clock.t += 1.0
        tokens = 128 * (i % 16)
        est.observe_transfer("p", "d", tokens, 0.01 + tokens / 50000)
    seen, unseen = est.transfer("p", "d"), est.transfer("p", "d2")
    assert (seen.tokens_per_s, seen.overhead_s, unseen.tokens_per_s) == (
        pytest.approx(50000, rel=0.05), pytest.approx(0.01, rel=0.1), pytest.approx(50000, rel=0.2))


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan, math.inf])
def test_broken_samples_are_ignored(seconds):
    est = RateEstimator(clock=Clock())
    est.observe_gap("e", seconds, 4)
    assert est.rates("e").samples == 0.0


def test_forget_drops_an_engine_and_its_pairs():
    clock = Clock()
    est = RateEstimator(clock=clock)
    feed(est, clock, n=20)
    est.observe_transfer("p", "e", 100, 0.05)
    est.forget("e")
    assert (est.rates("e").samples, est.snapshot()["transfers"]) == (0.0, {})


def test_learned_rates_drive_placement():
    # the decode engine's streams measured slow: a long local prefill would stall them
    clock = Clock()
    est = RateEstimator(clock=clock)
    feed(est, clock, engine_id="d")
    engines = [est.estimate("p", "prefill"), est.estimate("d", "decode", decode_streams=12)]
    assert place(1024, engines, transfer=est.transfer).option == Option("d", "p")


def test_a_reused_solution_equals_a_fresh_one_and_a_sample_or_time_replaces_it():
    """Placement asks for one engine's rates once per option: the fit's solution is reused while
    nothing it depends on moved (no sample, the same prior, under 0.1 % of decay), and is the
    solution a fresh estimator would compute at that moment."""
    def fresh(t: float, n: int) -> float:
        clock = Clock()
        est = RateEstimator(clock=clock)
        feed(est, clock, n=n)
        clock.t = t
        return est.rates("e").prefill_tokens_per_s

    clock = Clock()
    est = RateEstimator(clock=clock)
    feed(est, clock, n=20)
    t0 = clock.t
    first = est.rates("e").prefill_tokens_per_s
    clock.t = t0 + 0.05  # within reuse_s (87 ms at the 60 s half-life): the same answer
    assert est.rates("e").prefill_tokens_per_s == first == fresh(t0, 20)
    clock.t = t0 + 600.0  # ten half-lives later the priors weigh more: a new solution, as a fresh fit's
    later = est.rates("e").prefill_tokens_per_s
    assert later != first and later == pytest.approx(fresh(t0 + 600.0, 20), rel=1e-9)
    est.observe_gap("e", A, 4)  # a sample: solved again at once
    assert est.rates("e").prefill_tokens_per_s != later
