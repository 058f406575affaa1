"""The SLO placement model's knobs (`router.slo`) and the chunk budget they imply, as plain config.

`PlacementConfig` holds the targets, weights and priors of the placement model
(serving.routing.slo_model uses them per request, serving.routing.rates starts its
estimates from the priors). `chunked_prefill_budget` is the one piece of that model the
deployment config needs itself: the vLLM chunk budget a decode-capable engine gets, from
the rates its role's live engines measured (`MeasuredRates`) or else from the priors
(`PlacementConfig.chunk_budget`, called by `DeploymentConfig.chunk_budget_of`). They live here, beside serving/config.py and
importing nothing of serving/, so that the config module stays the ground floor that the
routing layer imports, never the other way round.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# vLLM's max_num_batched_tokens for an engine raypd starts (AsyncLLM, UsageContext.ENGINE_CONTEXT):
# SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS on a CPU and a GPU alike (vLLM 0.32; the larger
# defaults of H100-class GPUs are those of the LLM class and `vllm serve`, not of an AsyncLLM)
VLLM_DEFAULT_BUDGET = 2048


class PlacementConfig(BaseModel):
    """Targets, weights, and the priors the rate estimator starts from (`serving.routing.rates`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_target_s: float = Field(1.0, gt=0)  # floor of the TTFT target
    ttft_slowdown: float = Field(3.0, ge=0)  # target >= this x the prompt's idle compute time (0: floor only)
    itl_target_s: float = Field(0.25, gt=0)  # per-step gap of the streams already decoding
    first_gap_target_s: float = Field(1.0, gt=0)  # this request's first->second token gap
    ttft_weight: float = Field(1.0, ge=0)
    itl_weight: float = Field(1.0, ge=0)  # one stream-second of stall vs one second of TTFT excess
    remote_first_token_overhead_s: float = Field(0.03, ge=0)  # the remote path's extra before token one
    # priors, used until engines report samples (any machine, any model: samples replace them in seconds)
    prior_prefill_tokens_per_s: float = Field(400.0, gt=0)
    prior_step_s: float = Field(0.05, gt=0)  # a decode step's fixed part
    prior_step_per_stream_s: float = Field(0.001, gt=0)  # ...and its growth per stream in the batch
    prior_transfer_tokens_per_s: float = Field(20000.0, gt=0)
    prior_transfer_overhead_s: float = Field(0.1, gt=0)
    default_chunk_budget_tokens: int = Field(VLLM_DEFAULT_BUDGET, ge=1)  # when an engine's is unknown
    # online learning: exponentially weighted, by age
    rate_half_life_s: float = Field(60.0, gt=0)
    transfer_half_life_s: float = Field(120.0, gt=0)
    prior_weight: float = Field(1.0, gt=0)  # the priors count as this many average samples
    min_history_weight: float = Field(4.0, ge=0)  # idle time never decays what was learned below this
    # a stream's mean inter-token gap: at most this x its decode engine's bare step (or itl_target_mean)
    mean_itl_slowdown: float = Field(1.5, ge=1.0)
    itl_target_mean_s: float = Field(0.0, ge=0)
    prefill_busy_window_s: float = Field(10.0, gt=0)  # how far back an engine's prefill share is measured
    max_prefill_busy: float = Field(0.9, gt=0, lt=1)

    def chunk_budget(self, measured: MeasuredRates | None, max_num_seqs: int, block_size: int) -> ChunkBudget:
        """The chunk budget that keeps a step with a prefill chunk within `itl_target_s`, at the rates
        an engine's role `measured` when there are some, else at the priors."""
        if measured is None:
            tokens = chunked_prefill_budget(self.prior_step_s, self.prior_prefill_tokens_per_s, self.itl_target_s,
                                            max_num_seqs=max_num_seqs, block_size=block_size)
            return ChunkBudget(tokens, "priors")
        tokens = chunked_prefill_budget(measured.step_s, measured.prefill_tokens_per_s, self.itl_target_s,
                                        max_num_seqs=max_num_seqs, block_size=block_size)
        return ChunkBudget(tokens, "measured")



def chunked_prefill_budget(step_time_s: float, prefill_rate: float, itl_target_s: float, *,
                           max_num_seqs: int = 128, block_size: int = 128, max_tokens: int = 16384) -> int:
    """vLLM's max_num_batched_tokens such that a step carrying a local prefill chunk stays within the target.

    A mixed step costs about step_time_s + budget / prefill_rate, so the budget is
    (itl_target_s - step_time_s) * prefill_rate tokens, rounded down to whole
    blocks (each chunk then ends on a block boundary: its blocks are complete,
    cacheable and published by the step that wrote them). Bounds: at least
    max(max_num_seqs, block_size) (vLLM refuses a budget below max_num_seqs, and a
    chunk under one block leaves a partial block every step); at most
    `max_tokens` (vLLM's largest default). When even the lower bound exceeds the
    target (a slow engine, a tight target), the lower bound is returned: the
    target cannot be kept by the budget alone (fewer max_num_seqs, or
    disaggregation, must do it).
    """
    if prefill_rate <= 0 or step_time_s < 0 or itl_target_s <= 0:
        raise ValueError("rates and targets must be positive")
    floor = max(max_num_seqs, block_size)
    raw = (itl_target_s - step_time_s) * prefill_rate
    blocks = int(raw // block_size) * block_size if raw > 0 else 0
    return max(floor, min(max_tokens, blocks))


def vllm_default_budget(engine_kwargs: Mapping[str, Any]) -> int:
    """vLLM's own max_num_batched_tokens for an engine raypd starts with these engine arguments
    (none of them setting it): `VLLM_DEFAULT_BUDGET`, doubled by `performance_mode: throughput`
    as vLLM does (`EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`)."""
    return VLLM_DEFAULT_BUDGET * (2 if engine_kwargs.get("performance_mode") == "throughput" else 1)


@dataclass(frozen=True)
class ChunkBudget:
    """vLLM's max_num_batched_tokens for one role's engines, and where it comes from."""

    tokens: int
    source: Literal["operator", "measured", "priors"]


@dataclass(frozen=True)
class MeasuredRates:
    """What the live engines of one role measured of themselves (their one rate model, `actors.rates`,
    read through `EngineActor.load()`): the prefill rate they fitted (prompt tokens per second, the
    tokens queued ahead of each prefill counted as work) and one decode step at their recent batch
    (so it errs long under load, toward a smaller, safer budget)."""

    prefill_tokens_per_s: float
    step_s: float

    @classmethod
    def of(cls, prefill_rates: Sequence[float | None], step_times: Sequence[float | None]) -> "MeasuredRates | None":
        """The medians of the engines' own numbers (one engine's odd load moves them little);
        None unless both a prefill rate and a step time were measured."""
        rates = [r for r in prefill_rates if r is not None and r > 0]
        steps = [s for s in step_times if s is not None and s > 0]
        if not rates or not steps:
            return None
        return cls(statistics.median(rates), statistics.median(steps))
