"""P:D autoscaling policy: each role on its own signals, bounds, hysteresis, delays and cooldowns."""

from __future__ import annotations

import pytest

from serving.autoscaler_config import AutoscalerConfig
from serving.cluster.autoscale_policy import PoolSignals, RolePolicy
from serving.config import ConfigError, DeploymentConfig
from serving.placement_config import SloTargets

CFG = AutoscalerConfig(
    enabled=True, up_delay_s=2.0, up_cooldown_s=5.0, down_delay_s=10.0, cooldown_s=30.0, down_fraction=0.5,
    prefill={"min": 1, "max": 3, "queued_tokens_per_engine": 1000, "ttft_target_factor": 1.0},
    decode={"min": 1, "max": 3, "outstanding_tokens_per_engine": 500, "kv_usage_high": 0.8, "itl_target_factor": 1.0},
)
SLO = SloTargets(ttft_target_s=1.0, itl_target_s=0.1)  # the deployment's one pair of targets


def policies():
    return RolePolicy("prefill", CFG.prefill, CFG, SLO), RolePolicy("decode", CFG.decode, CFG, SLO)


def test_long_prompts_press_on_prefill_only():
    prefill, decode = policies()
    s = PoolSignals(engines=1, queued_prompt_tokens=5000, outstanding_tokens=40)
    assert prefill.decide(s, 0.0).direction == "hold"  # pressure must last up_delay_s
    d = prefill.decide(s, 2.0)
    assert (d.direction, d.target, d.reason) == ("up", 2, "queued_prompt_tokens")
    assert decode.decide(s, 2.0).direction == "hold"


def test_long_answers_press_on_decode_only():
    prefill, decode = policies()
    s = PoolSignals(engines=1, queued_prompt_tokens=50, outstanding_tokens=2000)
    decode.decide(s, 0.0)
    assert (decode.decide(s, 2.0).direction, decode.decide(s, 2.0).reason) == ("up", "outstanding_tokens")
    assert prefill.decide(s, 2.0).direction != "up"


@pytest.mark.parametrize("signals,reason", [
    (PoolSignals(engines=1, prefill_latency_p90_s=1.5), "ttft"),
])
def test_prefill_latency_over_target_is_pressure(signals, reason):
    prefill, _ = policies()
    assert prefill.pressure(signals) == reason


@pytest.mark.parametrize("signals,reason", [
    (PoolSignals(engines=2, kv_usage=0.9), "kv_usage"),
    (PoolSignals(engines=2, itl_p90_s=0.2), "itl"),
])
def test_kv_usage_and_itl_over_target_are_decode_pressure(signals, reason):
    _, decode = policies()
    assert decode.pressure(signals) == reason


def test_no_growth_past_max_and_after_a_change_the_up_cooldown_holds():
    prefill, _ = policies()
    hot = PoolSignals(engines=2, queued_prompt_tokens=10_000)
    prefill.decide(hot, 0.0)
    assert prefill.decide(hot, 2.0).direction == "up"
    prefill.applied(2.0)
    prefill.decide(hot, 3.0)
    assert prefill.decide(hot, 5.5).direction == "hold"  # up_cooldown_s 5 since the change
    assert prefill.decide(hot, 7.5).direction == "up"
    assert prefill.decide(PoolSignals(engines=3, queued_prompt_tokens=10_000), 20.0).direction == "hold"


def test_shrink_needs_the_smaller_pool_under_half_of_every_threshold_for_the_delay_and_cooldown():
    _, decode = policies()
    decode.applied(0.0)
    # 2 engines, 300 outstanding: with one engine fewer 300 > 0.5 * 500: not idle (hysteresis band)
    assert decode.decide(PoolSignals(engines=2, outstanding_tokens=300), 40.0).reason == "steady"
    calm = PoolSignals(engines=2, outstanding_tokens=200)
    assert decode.decide(calm, 41.0).direction == "hold"  # idle, but not for down_delay_s yet
    d = decode.decide(calm, 51.0)
    assert (d.direction, d.target, d.reason) == ("down", 1, "idle")
    decode.applied(51.0)
    assert decode.decide(PoolSignals(engines=2), 70.0).direction == "hold"  # cooldown_s 30 since the change


def test_never_below_min_and_a_pool_under_min_is_restored():
    prefill, decode = policies()
    assert decode.decide(PoolSignals(engines=1), 1000.0).direction == "hold"
    d = prefill.decide(PoolSignals(engines=0), 0.0)
    assert (d.direction, d.reason) == ("up", "below_min")


def test_a_pressure_spike_resets_the_idle_delay():
    _, decode = policies()
    decode.decide(PoolSignals(engines=2), 0.0)
    decode.decide(PoolSignals(engines=2, outstanding_tokens=5000), 8.0)
    assert decode.decide(PoolSignals(engines=2), 12.0).direction == "hold"
    assert decode.decide(PoolSignals(engines=2), 40.0).direction == "down"


def test_deployment_counts_must_lie_within_the_bounds_when_enabled():
    with pytest.raises(ConfigError, match="prefill.count 3 must lie within autoscaler.prefill min 1 .. max 2"):
        DeploymentConfig.from_dict({"prefill": {"count": 3}, "autoscaler": {"enabled": True,
                                                                            "prefill": {"min": 1, "max": 2}}})
    with pytest.raises(ConfigError, match="min 3 > max 2"):
        DeploymentConfig.from_dict({"autoscaler": {"decode": {"min": 3, "max": 2}}})


def test_the_autoscalers_latency_limits_are_factors_of_the_deployments_one_target():
    cfg = DeploymentConfig.from_dict({"router": {"slo": {"ttft_target_s": 1.5, "itl_target_s": 0.2}},
                                      "autoscaler": {"decode": {"itl_target_factor": 2.0}}})
    prefill = RolePolicy("prefill", cfg.autoscaler.prefill, cfg.autoscaler, cfg.router.slo)
    decode = RolePolicy("decode", cfg.autoscaler.decode, cfg.autoscaler, cfg.router.slo)
    assert (prefill.latency_limit_s, decode.latency_limit_s) == (3.0, 0.4)  # the prefill factor's default: 2
