"""The one rate model (pure, injected clock): an engine's own fit from its priors to what it measures
(`actors.engine.rate_model`), and the router's reading of what engines published (`serving.routing.rates`)."""

from __future__ import annotations

import math
import random

import pytest

from actors.engine.config import RateModelConfig
from actors.engine.rate_model import EngineRateModel
from actors.rates import EngineRates
from serving.routing.slo_model import Option, place
from serving.routing.rates import RateEstimator

# what the engine "really" does: a 20 ms step, +2 ms per stream, 1000 prompt tokens/s
A, B, C = 0.02, 0.002, 1 / 1000


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def feed(model: EngineRateModel, clock: Clock, n: int = 200, a: float = A, b: float = B, c: float = C,
         seed: int = 1) -> None:
    """Inter-token gaps and prefill times of one engine, as its load meter sees them."""
    rng = random.Random(seed)
    for i in range(n):
        clock.t += 0.5
        batch = rng.randint(0, 16)
        if i % 3 == 0:
            tokens = rng.randint(256, 1024)  # long enough to teach c (`min_prefill_steps`)
            model.observe_prefill(tokens, a + b * batch + c * tokens, batch)
        else:
            model.observe_gap(a + b * batch, batch)


def measured(clock: Clock, n: int = 200, **kw) -> EngineRates:
    model = EngineRateModel(clock=clock)
    feed(model, clock, n, **kw)
    return model.rates()


# ------------------------------------------------------------------ the engine's own fit
def test_priors_until_the_first_sample():
    cfg = RateModelConfig(prior_prefill_tokens_per_s=300.0, prior_step_s=0.04)
    r = EngineRateModel(cfg, clock=Clock()).rates()
    assert (r.prefill_tokens_per_s, r.step_s, r.samples, r.measured) == (
        pytest.approx(300.0), pytest.approx(0.04), 0.0, False)


def test_rates_converge_from_the_priors_to_the_measured_ones():
    r = measured(Clock())
    assert (r.prefill_tokens_per_s, r.step_s, r.step_per_stream_s) == (
        pytest.approx(1000, rel=0.02), pytest.approx(A, rel=0.05), pytest.approx(B, rel=0.05))
    assert r.samples > 0 and 0 < r.prefill_samples < r.samples


def test_a_few_samples_already_move_the_estimate_most_of_the_way():
    r = measured(Clock(), n=10)  # four of them prefills
    assert r.prefill_samples == pytest.approx(4.0, rel=0.05)  # decayed a little meanwhile
    assert r.prefill_tokens_per_s > 800  # prior 400 tokens/s, true 1000


def test_the_estimate_follows_an_engine_that_slows_down():
    clock = Clock()
    model = EngineRateModel(RateModelConfig(rate_half_life_s=10.0), clock=clock)
    feed(model, clock)
    feed(model, clock, c=2 / 1000, seed=2)  # 100 s later: half the prefill rate
    assert model.rates().prefill_tokens_per_s == pytest.approx(500, rel=0.05)


def test_what_was_learned_survives_an_idle_hour():
    """Idle time decays history down to `min_history_weight` samples (a third of them prefills here),
    against priors worth `prior_weight` average samples: the rates stay nearer the measured ones."""
    clock = Clock()
    model = EngineRateModel(clock=clock)
    feed(model, clock)
    clock.t += 3600
    r = model.rates()
    assert (r.samples, r.prefill_samples) == (4.0, pytest.approx(4.0 / 3, rel=0.2))
    assert r.prefill_tokens_per_s > 700 and r.step_s == pytest.approx(A, rel=0.7)


def test_a_short_prompts_fixed_cost_does_not_reach_the_prefill_rate():
    """A 48-token prompt whose first token took 0.25 s (its fixed path: hand-off, sampling, output)
    would read as ~200 tokens/s; it teaches nothing, neither to a fresh engine (the prior stands)
    nor to one that measured long prompts at 1000 tokens/s. A long prompt still teaches."""
    clock = Clock()
    fresh = EngineRateModel(clock=clock)
    fresh.observe_prefill(48, 0.25, 0)
    assert (fresh.rates().prefill_samples, fresh.rates().prefill_tokens_per_s) == (0.0, pytest.approx(400))
    model = EngineRateModel(clock=clock)
    feed(model, clock)
    before = model.rates()
    model.observe_prefill(48, 0.25, 0)
    assert model.rates().prefill_tokens_per_s == pytest.approx(before.prefill_tokens_per_s)
    assert model.min_prefill_tokens() == pytest.approx(8 * A / C, rel=0.1)  # 160 tokens at 20 ms, 1000 tok/s
    model.observe_prefill(800, A + 800 * C, 0)
    assert model.rates().prefill_samples > before.prefill_samples


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan, math.inf])
def test_broken_samples_are_ignored(seconds):
    model = EngineRateModel(clock=Clock())
    model.observe_gap(seconds, 4)
    assert model.rates().samples == 0.0


def test_a_reused_solution_equals_a_fresh_one_and_a_sample_or_time_replaces_it():
    """Rates are asked often (every publication check): the fit's solution is reused while nothing it
    depends on moved (no sample, the same prior, under 0.1 % of decay), and is the solution a fresh
    model would compute at that moment."""
    def fresh(t: float, n: int) -> float:
        clock = Clock()
        model = EngineRateModel(clock=clock)
        feed(model, clock, n=n)
        clock.t = t
        return model.rates().prefill_tokens_per_s

    clock = Clock()
    model = EngineRateModel(clock=clock)
    feed(model, clock, n=20)
    t0 = clock.t
    first = model.rates().prefill_tokens_per_s
    clock.t = t0 + 0.05  # within reuse_s (87 ms at the 60 s half-life): the same answer
    assert model.rates().prefill_tokens_per_s == first == fresh(t0, 20)
    clock.t = t0 + 600.0  # ten half-lives later the priors weigh more: a new solution, as a fresh fit's
    later = model.rates().prefill_tokens_per_s
    assert later != first and later == pytest.approx(fresh(t0 + 600.0, 20), rel=1e-9)
    model.observe_gap(A, 4)  # a sample: solved again at once
    assert model.rates().prefill_tokens_per_s != later


# ------------------------------------------------------- what a router reads of it
def test_a_router_reads_the_published_rates_and_starts_a_new_engine_from_the_others():
    clock = Clock()
    est = RateEstimator(clock=clock)
    assert est.rates("e").prefill_tokens_per_s == pytest.approx(400)  # nothing published: the priors
    est.adopt({"e": measured(clock)})
    assert est.rates("e").prefill_tokens_per_s == pytest.approx(1000, rel=0.02)
    assert est.rates("new").prefill_tokens_per_s == pytest.approx(1000, rel=0.02)  # pooled
    assert est.rates("new").samples == 0.0


def test_an_engine_that_measured_steps_but_no_prefill_takes_the_pooled_prefill_rate():
    clock = Clock()
    decode_only = EngineRateModel(clock=clock)
    for _ in range(50):
        clock.t += 0.1
        decode_only.observe_gap(A + B * 4, 4)
    est = RateEstimator(clock=clock)
    est.adopt({"p": measured(clock), "d": decode_only.rates()})
    d = est.rates("d")
    assert d.prefill_samples == 0 and d.step_s == pytest.approx(decode_only.rates().step_s)
    assert d.prefill_tokens_per_s == pytest.approx(est.rates("p").prefill_tokens_per_s)


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


def test_a_failed_pulls_cost_prices_the_pair_halves_with_time_and_a_good_pull_clears_it():
    clock = Clock()
    est = RateEstimator(clock=clock)  # transfer_half_life_s 120
    base = est.transfer("p", "d")
    est.observe_failed_transfer("p", "d", 8.0)  # a sync wait that failed, then the recompute
    assert est.transfer("p", "d").overhead_s == pytest.approx(base.overhead_s + 8.0)
    assert est.transfer("p", "d2") == base  # only that pair
    assert est.pairs()[("p", "d")].overhead_s == pytest.approx(base.overhead_s + 8.0)
    clock.t += 120
    assert est.failure_penalty_s("p", "d") == pytest.approx(4.0)
    est.observe_failed_transfer("p", "d", 1.0)  # a cheaper failure keeps what is left of the dearer one
    assert est.failure_penalty_s("p", "d") == pytest.approx(4.0)
    est.observe_transfer("p", "d", 1000, 0.2)
    assert est.failure_penalty_s("p", "d") == 0.0


def test_a_pair_priced_by_its_failed_pulls_loses_the_placement_it_won():
    """Two both engines, the decode one streaming two answers: a long prompt is pulled from the idle one
    (itl_protect) until a failed pull's cost prices the pair; then it is prefilled where it decodes."""
    clock = Clock()
    est = RateEstimator(clock=clock)
    est.adopt({"d": EngineRates(A, B, C, decode_streams=2, samples=100, prefill_samples=50),
               "p": EngineRates(A, B, C, samples=100, prefill_samples=50)})

    def chosen():
        engines = [est.estimate(e, "both", decode_streams=2 if e == "d" else 0) for e in ("d", "p")]
        return place(1500, engines, est.config, est.transfer, lambda p, d: d == "d").option.prefill_id

    assert chosen() == "p"
    est.observe_failed_transfer("p", "d", 8.0)
    assert chosen() is None


def test_forget_drops_an_engines_pairs_and_hop():
    est = RateEstimator(clock=Clock())
    est.observe_transfer("p", "e", 100, 0.05)
    est.observe_failed_transfer("q", "e", 3.0)
    est.observe_hop("e", 0.2)
    est.forget("e")
    assert (est.pairs(), est.hop_s("e")) == ({}, 0.0)


def test_published_rates_drive_placement():
    # the decode engine measured slow steps: a long local prefill would stall its streams
    clock = Clock()
    est = RateEstimator(clock=clock)
    est.adopt({"d": measured(clock)})
    engines = [est.estimate("p", "prefill"), est.estimate("d", "decode", decode_streams=12)]
    assert place(1024, engines, transfer=est.transfer).option == Option("d", "p")
