"""The SLO placement model's knobs (`router.slo`) and the chunk budget they imply, as plain config.

`PlacementConfig` holds the targets, weights and priors of the placement model
(serving.routing.slo_model uses them per request, serving.routing.rates starts its
estimates from the priors). `chunked_prefill_budget` is the one piece of that model the
deployment config needs itself: the vLLM chunk budget a decode-capable engine gets, from
the rates its role's live engines measured (`MeasuredRates`) or else from the priors
(`PlacementConfig.chunk_budget`, called by `DeploymentConfig.chunk_budget_of`). They live here,
beside serving/config.py and importing nothing of serving/, so that the config module stays the
ground floor that the routing layer imports, never the other way round.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from actors.config_base import StrictModel
from actors.engine.config import RatePriors


def __getattr__(name: str) -> Any:
    """`VLLM_DEFAULT_BUDGET`: `vllm serve`'s max_num_batched_tokens for a one-rank engine on this host,
    read from vLLM's table on first use (`vllm_default_budget`), never a number written here."""
    if name == "VLLM_DEFAULT_BUDGET":
        return vllm_default_budget({})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SloTargets(StrictModel):
    """The deployment's TTFT and ITL targets: one pair, read by the router's placement model
    (`router.slo`, which carries them) and by the autoscaler (as factors of them)."""

    ttft_target_s: float = Field(1.0, gt=0, description=(
        "time to first token a request should get: the floor of its target (see `ttft_slowdown`)"))
    itl_target_s: float = Field(0.25, gt=0, description=(
        "the longest gap one step may put between two tokens of the streams already decoding (a local "
        "prefill chunk included); also sets the chunk budget raypd gives CPU engines"))


class PlacementConfig(RatePriors, SloTargets):
    """The SLO targets, the placement model's weights, and the priors the rate estimator starts from
    (`serving.routing.rates`)."""

    ttft_slowdown: float = Field(3.0, ge=0, description=(
        "a request's TTFT target is at least this x its prompt's prefill time on the fastest engine "
        "(0: `ttft_target_s` alone)"))
    first_gap_target_s: float | None = Field(None, gt=0, description=(
        "a request's own first->second token gap target (unset: `itl_target_s`)"))
    ttft_weight: float = Field(1.0, ge=0, description="the weight of one second of TTFT over its target")
    itl_weight: float = Field(1.0, ge=0, description=(
        "the weight of one stream-second of decode stall (against one second of TTFT excess)"))
    remote_first_token_overhead_s: float = Field(0.03, ge=0, description=(
        "what the disaggregated path adds before the first token (the hop to the prefill engine and back)"))
    prior_transfer_tokens_per_s: float = Field(20000.0, gt=0, description=(
        "prior of a KV pull's rate, until the router measured a pair's pulls"))
    prior_transfer_overhead_s: float = Field(0.1, gt=0, description="prior of a KV pull's fixed cost")
    default_chunk_budget_tokens: int | None = Field(None, ge=1, description=(
        "an engine's chunk budget (vLLM's max_num_batched_tokens) while it published none (unset: "
        "`vllm serve`'s default on the host that asks, from vLLM's table)"))
    transfer_half_life_s: float = Field(120.0, gt=0, description=(
        "half-life of a pair's KV pull samples in the router's fit"))
    mean_itl_slowdown: float = Field(1.5, ge=1.0, description=(
        "a stream's mean inter-token gap target: this x its decode engine's bare step (or "
        "`itl_target_mean_s`, the larger)"))
    itl_target_mean_s: float = Field(0.0, ge=0, description="a stream's mean inter-token gap target (0: none)")
    max_prefill_busy: float = Field(0.9, gt=0, lt=1, description=(
        "the cap on the share of an engine's time the model counts as prefilling (what stretches the "
        "inter-token gaps of the streams placed there)"))

    def chunk_budget_fallback(self) -> int:
        """The budget assumed for an engine that published none (`default_chunk_budget_tokens`)."""
        return self.default_chunk_budget_tokens or vllm_default_budget({})

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


def vllm_default_budget(engine_kwargs: Mapping[str, Any], world_size: int = 1) -> int:
    """`vllm serve`'s max_num_batched_tokens on this host for an engine of `world_size` ranks with these
    engine arguments (none of them setting it): vLLM's own table, doubled by `performance_mode:
    throughput` as vLLM does (`actors.engine.vllm.serve_defaults`)."""
    from actors.engine.vllm.serve_defaults import serve_batch_defaults

    return serve_batch_defaults(world_size, engine_kwargs.get("performance_mode")).max_num_batched_tokens


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
