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
    min: int = Field(1, ge=0, le=64)
    max: int = Field(1, ge=0, le=64)
    queued_tokens_per_engine: int = Field(8192, ge=1)
    # the pool's p90 prefill latency (its part of TTFT) may reach this x router.slo.ttft_target_s
    ttft_target_factor: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> "PrefillScaling":
        if self.min > self.max:
            raise ValueError(f"min {self.min} > max {self.max}")
        return self


class DecodeScaling(StrictModel):
    min: int = Field(1, ge=1, le=64)
    max: int = Field(1, ge=1, le=64)
    outstanding_tokens_per_engine: int = Field(8192, ge=1)
    kv_usage_high: float = Field(0.85, gt=0, le=1)
    itl_target_factor: float = Field(1.0, gt=0)  # the pool's p90 ITL may reach this x router.slo.itl_target_s

    @model_validator(mode="after")
    def _bounds(self) -> "DecodeScaling":
        if self.min > self.max:
            raise ValueError(f"min {self.min} > max {self.max}")
        return self


class AutoscalerConfig(StrictModel):
    enabled: bool = False
    interval_s: float = Field(2.0, gt=0)
    up_delay_s: float = Field(0.0, ge=0)
    up_cooldown_s: float = Field(5.0, ge=0)
    down_delay_s: float = Field(30.0, ge=0)
    cooldown_s: float = Field(60.0, ge=0)
    down_fraction: float = Field(0.5, gt=0, lt=1)
    drain_quiet_s: float = Field(5.0, ge=0)  # idle this long (router views refreshed, no prefill in flight) before stop
    drain_timeout_s: float = Field(600.0, gt=0)  # a drain that never gets idle stops anyway (counted)
    policy: Literal["model", "thresholds"] = "model"
    prefill: PrefillScaling = PrefillScaling()
    decode: DecodeScaling = DecodeScaling()
    both: DecodeScaling = DecodeScaling()  # role-flexible engines: bounds of their count
