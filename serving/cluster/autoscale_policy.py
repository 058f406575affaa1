"""P:D autoscaling policy (pure): how many prefill, decode and role-flexible engines.

Each role is scaled between `min` and `max` by its own `RolePolicy`, from the shape planner's
simulation of the live pools (`model`, the default: `serving.sizing.live`) or per-role thresholds
(`thresholds`). Invariants: a role changes by one engine at a time, grows only after its pressure
lasted `up_delay_s` and `up_cooldown_s` passed, and shrinks only when the pool *with one engine
fewer* would stay under `down_fraction` of every threshold for `down_delay_s`. Pure, with the time
passed in: `serving.cluster.autoscaler` applies it; the knobs are `serving.autoscaler_config`.
What says a role needs an engine more or fewer: `RolePolicy`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from serving.autoscaler_config import AutoscalerConfig, DecodeScaling, PrefillScaling
from serving.placement_config import SloTargets


@dataclass(frozen=True)
class PoolSignals:
    """A role's serving engines (not starting, not draining) and their summed load."""

    engines: int
    queued_prompt_tokens: float = 0.0
    prefill_latency_p90_s: float | None = None
    outstanding_tokens: float = 0.0
    kv_usage: float = 0.0  # the highest of the pool
    itl_p90_s: float | None = None


@dataclass(frozen=True)
class ScaleDecision:
    role: str
    current: int
    target: int
    reason: str

    @property
    def direction(self) -> Literal["up", "down", "hold"]:
        return "up" if self.target > self.current else "down" if self.target < self.current else "hold"


def _over(value: float | None, limit: float) -> bool:
    return value is not None and value > limit


def _under(value: float | None, limit: float) -> bool:
    return value is None or value < limit


class RolePolicy:
    """Each role is scaled between `min` and `max` by its own `RolePolicy`. What says a role
    needs one more engine, or could do with one fewer (`autoscaler.policy`):

      model       (default) the shape planner's simulation of the live pools
                  (`serving.sizing.live`, fed with the rates the engines measured of
                  themselves, the arrival rate and the request mix, requests placed by the
                  router's own `place()`): when the pools are predicted to miss a target, the
                  pool whose extra engine helps most grows; one predicted to stay well within
                  its targets with one engine fewer shrinks; with role `both` engines it is
                  the engine count;
      thresholds  the per-role thresholds below:

      prefill  pressure: queued prompt tokens per engine above `queued_tokens_per_engine`,
               or the p90 prefill latency (the pool's part of TTFT) above `ttft_target_factor` x
               the deployment's TTFT target (`router.slo.ttft_target_s`);
      decode   pressure: outstanding tokens per engine above `outstanding_tokens_per_engine`,
               KV usage above `kv_usage_high`, or the p90 inter-token latency above
               `itl_target_factor` x the deployment's ITL target (`router.slo.itl_target_s`).

    Queues are the engines' time-weighted averages (`actors.engine.load`), summed over
    the role's serving engines. Hysteresis: a role grows by one engine once its
    pressure has lasted `up_delay_s` and `up_cooldown_s` passed since its last change;
    it shrinks by one only when the pool *with one engine fewer* would stay under
    `down_fraction` of every threshold, for `down_delay_s`, and `cooldown_s` after its
    last change. Pure, with the time passed in: `serving.cluster.autoscaler` applies it.
    The knobs (`AutoscalerConfig`) are plain config in `serving.autoscaler_config`.
    """

    def __init__(self, role: Literal["prefill", "decode", "both"], scaling: PrefillScaling | DecodeScaling,
                 cfg: AutoscalerConfig, targets: SloTargets):
        self.role, self.scaling, self.cfg = role, scaling, cfg
        # the role's latency limit: a factor of the deployment's one target (`router.slo`)
        self.latency_limit_s = (scaling.ttft_target_factor * targets.ttft_target_s
                                if isinstance(scaling, PrefillScaling) else scaling.itl_target_factor * targets.itl_target_s)
        self.pressure_since: float | None = None
        self.idle_since: float | None = None
        self.last_change = -math.inf

    def pressure(self, s: PoolSignals) -> str | None:
        """Why the role needs one more engine, or None."""
        n = max(1, s.engines)
        if self.role == "prefill":
            p = self.scaling
            if s.queued_prompt_tokens / n > p.queued_tokens_per_engine:
                return "queued_prompt_tokens"
            if _over(s.prefill_latency_p90_s, self.latency_limit_s):
                return "ttft"
            return None
        d = self.scaling
        if s.outstanding_tokens / n > d.outstanding_tokens_per_engine:
            return "outstanding_tokens"
        if s.kv_usage > d.kv_usage_high:
            return "kv_usage"
        if _over(s.itl_p90_s, self.latency_limit_s):
            return "itl"
        return None

    def idle(self, s: PoolSignals) -> bool:
        """Would one engine fewer stay under `down_fraction` of every threshold?"""
        if s.engines <= 0:
            return False
        fewer = max(1, s.engines - 1)
        f = self.cfg.down_fraction
        if self.role == "prefill":
            p = self.scaling
            return (s.queued_prompt_tokens / fewer < f * p.queued_tokens_per_engine
                    and _under(s.prefill_latency_p90_s, f * self.latency_limit_s))
        d = self.scaling
        return (s.outstanding_tokens / fewer < f * d.outstanding_tokens_per_engine
                and s.kv_usage * s.engines / fewer < f * d.kv_usage_high
                and _under(s.itl_p90_s, f * self.latency_limit_s))

    def decide(self, s: PoolSignals, now: float, advice: Any = None) -> ScaleDecision:
        """`advice`: the planner's `scale_advice` answer (policy model), else the thresholds decide."""
        lo, hi = self.scaling.min, self.scaling.max
        if s.engines < lo:
            return ScaleDecision(self.role, s.engines, lo, "below_min")
        if s.engines > hi:
            return ScaleDecision(self.role, s.engines, hi, "above_max")
        if advice is not None:
            mine = advice.role == self.role
            why = advice.reason if mine and advice.delta > 0 else None
            idle = mine and advice.delta < 0
        else:
            why = self.pressure(s)
            idle = why is None and self.idle(s)
        self.pressure_since = (self.pressure_since if self.pressure_since is not None else now) if why else None
        self.idle_since = (self.idle_since if self.idle_since is not None else now) if idle else None
        if why and s.engines < hi and now - self.pressure_since >= self.cfg.up_delay_s \
                and now - self.last_change >= self.cfg.up_cooldown_s:
            return ScaleDecision(self.role, s.engines, s.engines + 1, why)
        if idle and s.engines > lo and now - self.idle_since >= self.cfg.down_delay_s \
                and now - self.last_change >= self.cfg.cooldown_s:
            return ScaleDecision(self.role, s.engines, s.engines - 1, "idle")
        return ScaleDecision(self.role, s.engines, s.engines, why or ("idle" if idle else "steady"))

    def applied(self, now: float) -> None:
        """The decision was acted on: restart the delays and the cooldown."""
        self.last_change = now
        self.pressure_since = self.idle_since = None
