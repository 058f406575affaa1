"""SLO-aware placement (pure): given rates, queues and cached prefixes, the chosen option and its reason."""

from __future__ import annotations

import math

import pytest

from serving.placement_config import PlacementConfig, chunked_prefill_budget
from serving.routing.slo_model import (
    EngineEstimate,
    Option,
    TransferEstimate,
    place,
)

# CPU-like numbers (SmolLM2 on one core): 400 prompt tokens/s, 50 ms steps, vLLM's default budget
RATE, STEP = 400.0, 0.05


def engine(engine_id: str, role: str, **kw) -> EngineEstimate:
    kw.setdefault("prefill_tokens_per_s", RATE)
    kw.setdefault("decode_step_s", STEP)
    return EngineEstimate(engine_id, role, **kw)


def pools(prefill: dict | None = None, decode: dict | None = None) -> list[EngineEstimate]:
    """One prefill engine p and one decode engine d (a fixed 1P+1D deployment)."""
    return [engine("p", "prefill", **(prefill or {})), engine("d", "decode", **(decode or {}))]


# ------------------------------------------------------------- fixed pools
def test_idle_cluster_short_prompt_runs_colocated_saving_the_handoff():
    p = place(128, pools())
    assert (p.option, p.reason) == (Option("d"), "colocated/ttft")


def test_long_prompt_while_the_decode_engine_streams_is_disaggregated_to_protect_itl():
    p = place(2048, pools(decode={"decode_streams": 16, "decode_step_s": 0.06}))
    assert (p.option, p.reason) == (Option("d", "p"), "disagg/itl_protect")


def test_saturated_prefill_engine_makes_the_idle_decode_engine_prefill():
    p = place(512, pools(prefill={"queued_prefill_tokens": 16384}))
    assert (p.option, p.reason) == (Option("d"), "colocated/prefill_queue")


def test_prefix_cached_on_the_decode_engine_keeps_the_request_there():
    # 48 uncached tokens: the stall on the 8 streams (0.05 + 48 / 400 s) stays under the ITL target
    p = place(2048, pools(decode={"decode_streams": 8, "cached_tokens": 2000}))
    assert (p.option, p.reason) == (Option("d"), "colocated/prefix_cached")


def test_prefix_held_by_the_prefill_engine_wins_a_tight_ttft_target():
    cfg = PlacementConfig(ttft_target_s=2.0, ttft_slowdown=0.0)
    p = place(2048, pools(prefill={"cached_tokens": 1900}), cfg)
    assert (p.option, p.reason) == (Option("d", "p"), "disagg/prefix_cached")


@pytest.mark.parametrize("prompt,kind", [(64, "colocated"), (128, "disagg")])
def test_the_old_short_prompt_threshold_emerges_from_the_itl_target(prompt, kind):
    # one stream on d: a local prefill is fine while STEP + prompt / RATE <= 0.25 s, i.e. below 80 tokens
    assert place(prompt, pools(decode={"decode_streams": 1})).option.kind == kind


def test_the_itl_target_is_the_knob_that_trades_stalls_for_the_handoff():
    cfg = PlacementConfig(itl_target_s=10.0)  # stalls of a few seconds are acceptable here
    p = place(2048, pools(decode={"decode_streams": 16}), cfg)
    assert (p.option, p.reason) == (Option("d"), "colocated/ttft")


@pytest.mark.parametrize("tpot_target_s,kind", [(0.1, "colocated"), (0.0, "disagg")])
def test_a_stall_costs_only_what_it_adds_past_each_streams_tpot_budget(tpot_target_s, kind):
    # 8 streams on d at 0.05 s steps, 64-token answers; a local 1024-token prefill holds one step for
    # 2.56 s (past the 0.25 s per-step target). Told a TPOT target of 0.1 s, each stream has 64 x
    # (0.1 - 0.05) = 3.2 s of budget left, which absorbs the stall: local, no handoff. With the default
    # budget (1.5 x the bare step: 1.6 s left) the stall overruns it and the prompt goes to p.
    cfg = PlacementConfig(itl_target_mean_s=tpot_target_s)
    p = place(1024, pools(decode={"decode_streams": 8}), cfg, answer_tokens=64)
    assert p.option.kind == kind


def test_when_nothing_meets_the_slo_the_least_violation_wins():
    p = place(512, pools(prefill={"queued_prefill_tokens": 16384}, decode={"decode_streams": 2}))
    assert (p.option, p.meets_slo) == (Option("d"), False)


# ------------------------------------------------------------ role "both"
def test_two_both_engines_the_less_loaded_one_prefills():
    p = place(1024, [engine("e1", "both", decode_streams=8), engine("e2", "both")])
    assert (p.option, p.reason) == (Option("e2"), "colocated/ttft")


def test_a_both_engine_busy_prefilling_hands_the_prompt_to_an_idle_prefill_engine():
    # x's own prompt chunks (budget 256) keep the pulled request's first gap under 1 s
    engines = [engine("p", "prefill"), engine("x", "both", queued_prefill_tokens=4096, chunk_budget_tokens=256)]
    p = place(256, engines)
    assert (p.option, p.reason) == (Option("x", "p"), "disagg/prefill_queue")


# ------------------------------------------------------ allowed options
def test_only_disaggregated_options_allowed():
    p = place(512, pools(), allowed=lambda prefill_id, _decode_id: prefill_id is not None)
    assert (p.option, p.reason) == (Option("d", "p"), "disagg/only_option")


def test_no_usable_prefill_engine_means_colocated():
    p = place(4096, pools(decode={"decode_streams": 16}), allowed=lambda prefill_id, _d: prefill_id is None)
    assert (p.option, p.reason) == (Option("d"), "colocated/no_prefill_engine")


def test_a_filtered_pair_is_never_predicted():
    engines = [engine("p0", "prefill"), engine("p1", "prefill"), engine("d", "decode")]
    p = place(512, engines, allowed=lambda prefill_id, _d: prefill_id != "p0")
    assert {pr.option.prefill_id for pr in p.predictions} == {None, "p1"}


def test_without_a_decode_capable_engine_there_is_no_placement():
    assert place(128, [engine("p", "prefill")]) is None


def test_ties_keep_the_callers_order_for_round_robin():
    a, b = engine("d0", "decode"), engine("d1", "decode")
    assert (place(128, [a, b]).option.decode_id, place(128, [b, a]).option.decode_id) == ("d0", "d1")


# ------------------------------------------------------------ predictions
def test_remote_ttft_is_queue_and_compute_on_the_prefill_engine_plus_the_handoff():
    cfg = PlacementConfig(remote_first_token_overhead_s=0.03)
    p = place(1000, pools(prefill={"queued_prefill_tokens": 600}, decode={"decode_streams": 8}), cfg)
    assert p.prediction.ttft_s == pytest.approx((600 + 1000) / RATE + 1 * STEP + 0.03)


def test_the_pull_is_in_the_first_gap_not_in_ttft():
    pull = TransferEstimate(tokens_per_s=10000.0, overhead_s=0.1)
    p = place(2048, pools(decode={"decode_streams": 16, "cached_tokens": 48}), transfer=lambda _p, _d: pull)
    assert p.prediction.first_gap_s == pytest.approx(0.1 + 2000 / 10000 + STEP)


def test_a_smaller_chunk_budget_lowers_the_stall_each_step_but_stalls_more_steps():
    p = place(2048, pools(decode={"decode_streams": 4, "chunk_budget_tokens": 256}))
    local = next(pr for pr in p.predictions if pr.option == Option("d"))
    assert (local.stall_gap_s, local.stalled_steps) == (pytest.approx(STEP + 256 / RATE), 8)


def test_rates_must_be_positive():
    with pytest.raises(ValueError):
        engine("d", "decode", prefill_tokens_per_s=0.0)


# ------------------------------------------------------ chunked prefill budget
def test_budget_keeps_one_mixed_step_within_the_itl_target():
    budget = chunked_prefill_budget(0.02, 20000.0, 0.1, max_num_seqs=256, block_size=16)
    assert budget == 1600 and 0.02 + budget / 20000.0 <= 0.1


def test_budget_rounds_down_to_whole_blocks():
    assert chunked_prefill_budget(0.05, 400.0, 0.26, max_num_seqs=16, block_size=16) == 80  # 84 -> 80


def test_budget_never_goes_below_max_num_seqs_or_a_block():
    # SmolLM2 on one core: 80 tokens would keep 0.25 s, vLLM needs >= max_num_seqs (128)
    assert chunked_prefill_budget(STEP, RATE, 0.25) == 128


def test_budget_is_capped_for_very_fast_engines():
    assert chunked_prefill_budget(0.0, 1e7, 1.0) == 16384


def test_budget_refuses_nonsense():
    with pytest.raises(ValueError):
        chunked_prefill_budget(0.05, 0.0, 0.25)


def test_a_budget_under_the_target_is_what_placement_then_predicts():
    budget = chunked_prefill_budget(STEP, RATE, 0.5, max_num_seqs=16, block_size=16)
    cfg = PlacementConfig(itl_target_s=0.5)
    p = place(2048, pools(decode={"decode_streams": 1, "chunk_budget_tokens": budget}), cfg)
    local = next(pr for pr in p.predictions if pr.option == Option("d"))
    assert local.stall_gap_s <= 0.5 and math.isclose(local.itl_violation_s, 0.0, abs_tol=1e-9)


# --------------------------------------------------- a stream's second token
def _cpu_engine(engine_id: str, **kw) -> EngineEstimate:
    """A one-core CPU engine as measured here: 281 prompt tokens/s, 60 ms steps, 128-token chunks."""
    return EngineEstimate(engine_id, "both", 281.0, 0.06, 128, 0.002, **kw)


def test_a_prompt_is_prefilled_away_from_a_stream_still_owed_its_second_token():
    # one 128-token chunk takes 0.46 s here: queued behind a's fresh stream it would hold that
    # stream's second token for a step of 0.52 s, past the 0.25 s ITL target
    # (a first: without its fresh stream the caller's order would pick it, as below)
    p = place(512, [_cpu_engine("a", decode_streams=1, fresh_streams=1), _cpu_engine("b", decode_streams=1)],
              answer_tokens=64)
    assert p.option == Option("b")


def test_a_stream_past_its_second_token_does_not_steer_the_prompt():
    # the same stall on a stream already streaming fits its TPOT budget: the caller's order decides
    p = place(512, [_cpu_engine("a", decode_streams=1), _cpu_engine("b", decode_streams=1)], answer_tokens=64)
    assert p.option == Option("a")

