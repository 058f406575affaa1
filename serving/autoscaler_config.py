"""The P:D autoscaler's knobs (a deployment's `autoscaler:` section), as plain config.

The bounds of each role's engine count and the thresholds, delays and cooldowns of
serving.cluster.autoscale_policy (its docstring says what each one decides). They live
here, beside serving/config.py and importing nothing of serving/, so that the config
module stays the ground floor that the cluster layer imports, never the other way round.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from actors.config_base import StrictModel


class PrefillScaling(StrictModel):
    """The prefill pool's bounds and, under `policy: thresholds`, what presses it to grow."""

    min: int = Field(1, ge=0, le=64, description="fewest engines of the pool")
    max: int = Field(1, ge=0, le=64, description="most engines of the pool")
    queued_tokens_per_engine: int = Field(8192, ge=1, description=(
        "thresholds: grow when the pool's queued prompt tokens per engine pass this"))
    ttft_target_factor: float = Field(2.0, gt=0, description=(
        "thresholds: grow when the pool's p90 prefill latency (its part of TTFT) passes this x "
        "`router.slo.ttft_target_s`"))

    @model_validator(mode="after")
    def _bounds(self) -> "PrefillScaling":
        if self.min > self.max:
            raise ValueError(f"min {self.min} > max {self.max}")
        return self


class DecodeScaling(StrictModel):
    """A decode-capable pool's bounds and, under `policy: thresholds`, what presses it to grow."""

    min: int = Field(1, ge=1, le=64, description="fewest engines of the pool")
    max: int = Field(1, ge=1, le=64, description="most engines of the pool")
    outstanding_tokens_per_engine: int = Field(8192, ge=1, description=(
        "thresholds: grow when the tokens the pool still owes its streams, per engine, pass this"))
    kv_usage_high: float = Field(0.85, gt=0, le=1, description=(
        "thresholds: grow when an engine's KV cache is fuller than this fraction"))
    itl_target_factor: float = Field(1.0, gt=0, description=(
        "thresholds: grow when the pool's p90 inter-token latency passes this x `router.slo.itl_target_s`"))

    @model_validator(mode="after")
    def _bounds(self) -> "DecodeScaling":
        if self.min > self.max:
            raise ValueError(f"min {self.min} > max {self.max}")
        return self


class AutoscalerConfig(StrictModel):
    """Sizes each engine pool the deployment runs between its bounds (the launcher runs it)."""

    enabled: bool = Field(False, description="run the autoscaler (the role counts are then the starting sizes)")
    interval_s: float = Field(2.0, gt=0, description="the control loop's period")
    up_delay_s: float = Field(0.0, ge=0, description="a pool grows once its pressure has lasted this long")
    up_cooldown_s: float = Field(5.0, ge=0, description="... and this long after the pool's last change")
    down_delay_s: float = Field(30.0, ge=0, description="a pool shrinks once it has been idle this long")
    cooldown_s: float = Field(60.0, ge=0, description="... and this long after the pool's last change")
    down_fraction: float = Field(0.5, gt=0, lt=1, description=(
        "shrink only when the pool with one engine fewer stays under this fraction of every threshold "
        "(policy model: of every target)"))
    drain_quiet_s: float = Field(5.0, ge=0, description=(
        "a draining engine is stopped once it has been idle this long (routers' views refreshed, no "
        "prefill, lease or handoff in flight)"))
    drain_timeout_s: float = Field(600.0, gt=0, description="a drain that never gets idle stops anyway (counted)")
    policy: Literal["model", "thresholds"] = Field("model", description=(
        "`model`: the shape planner's simulation of the live pools, fed with the engines' measured rates; "
        "`thresholds`: each pool's own thresholds below"))
    prefill: PrefillScaling = PrefillScaling()
    decode: DecodeScaling = DecodeScaling()
    both: DecodeScaling = Field(DecodeScaling(), description="role-flexible engines: the bounds of their count")
