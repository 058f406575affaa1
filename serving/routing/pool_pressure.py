"""Scaling advice from the placement model (pure): which pool to grow or shrink by one engine.

The autoscaler feeds the engines' `EngineEstimate`s (learned rates, budgets),
the recent arrival rate and request mix, and gets the pool whose predicted
violation dominates (`ScaleAdvice`). Per pool, at `arrival_rate` requests/s
spread evenly over its engines (u = uncached prompt tokens per request, a + bN
an engine's step with N streams, r its prefill rate):

  prefill pool   a queue of prefills: service S = u / r + ceil(u / B) * a per engine;
                 TTFT = Kingman wait (the pool as one server n times as fast) + S + handoff
  decode pool    streams by Little's law, N = lam_e * output_tokens * ITL, ITL = a + b N
  both pool      each engine prefills and decodes: it spends share = lam_e * u / r of its
                 time on prompt tokens, so decode steps stretch: ITL = (a + b N) / (1 - share),
                 and prefill steps carry the decode batch (S uses a + b N for a)

pressure = the worst predicted / target ratio (TTFT target as placement computes
it for the mix's prompt, `itl_target_s`); above 1 a target is predicted missed.

Fixed pools (there are prefill engines; a `both` engine counts in both pools,
an optimistic view of a mixed deployment): the pool with the highest pressure
above 1 grows (reason `ttft` or `itl`, whichever ratio is the worst). Otherwise
every engine prefills and decodes (all `both`, or decode engines without a
prefill pool: they prefill locally): one pool, scaled as an engine count.
A pool shrinks by its slowest engine when with one engine fewer its pressure
stays under `down_fraction` (and none is above 1). Bounds, delays, cooldowns
and draining stay with the autoscaler (serving.autoscale_policy.RolePolicy).

The pool model is a mean-value approximation for choosing a direction, not a
latency forecast: the router's placement also moves prefills between engines
of role `both`, which this colocated view does not credit (it is pessimistic
about their ITL).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from serving.placement_config import PlacementConfig
from serving.routing.placement import (
    DECODE_CAPABLE,
    PREFILL_CAPABLE,
    EngineEstimate,
    Role,
    ttft_target,
)


@dataclass(frozen=True)
class LoadMix:
    """The recent request mix, as the router sees it (moving averages)."""

    prompt_tokens: float
    output_tokens: float
    cached_fraction: float = 0.0  # share of prompt tokens the prefix caches held
    prompt_scv: float = 1.0  # squared coefficient of variation of the prefill work (1: exponential-like)


@dataclass(frozen=True)
class PoolPrediction:
    role: Role  # "both": the engines prefill and decode
    engines: int
    ttft_s: float | None  # None: the pool does not prefill
    itl_s: float | None  # None: the pool does not decode
    ttft_target_s: float
    itl_target_s: float

    @property
    def pressure(self) -> float:
        ratios = [v / t for v, t in ((self.ttft_s, self.ttft_target_s), (self.itl_s, self.itl_target_s))
                  if v is not None]
        return max(ratios) if ratios else math.inf

    @property
    def worst(self) -> str:
        """The target nearest to (or furthest past) its limit: ttft or itl."""
        if self.ttft_s is None:
            return "itl"
        if self.itl_s is None:
            return "ttft"
        return "ttft" if self.ttft_s / self.ttft_target_s >= self.itl_s / self.itl_target_s else "itl"


@dataclass(frozen=True)
class ScaleAdvice:
    role: Role | None
    delta: int  # +1, -1 or 0
    reason: str  # ttft | itl | idle | steady | no_engines
    pools: tuple[PoolPrediction, ...]  # the pools as they are now


def _queue_ttft(services: Sequence[float], arrival_rate: float, scv: float) -> float:
    """Mean wait + service of servers with these mean service times, pooled into one (Kingman)."""
    capacity = sum(1.0 / s for s in services)  # requests/s
    rho = arrival_rate / capacity
    if rho >= 1.0:
        return math.inf
    pooled = 1.0 / capacity  # the pooled server's service time
    return rho / (1.0 - rho) * pooled * (1.0 + scv) / 2.0 + len(services) / capacity


def _step_with_streams(e: EngineEstimate, lam_e: float, output_tokens: float, share: float) -> float:
    """a + b N at the stream count Little's law gives (inf when the batch would grow without bound)."""
    slack = (1.0 - share) - lam_e * output_tokens * e.step_per_stream_s
    if slack <= 0:
        return math.inf
    streams = lam_e * output_tokens * e.bare_step_s / slack
    return e.bare_step_s + e.step_per_stream_s * streams


def predict_pool(role: Role, engines: Sequence[EngineEstimate], arrival_rate: float, mix: LoadMix,
                 config: PlacementConfig, ttft_target_s: float) -> PoolPrediction:
    """One pool at `arrival_rate` requests/s spread evenly over its engines (module docstring)."""
    n = len(engines)
    if not n:
        return PoolPrediction(role, 0, math.inf if role != "decode" else None,
                              math.inf if role != "prefill" else None, ttft_target_s, config.itl_target_s)
    lam_e = arrival_rate / n
    u = max(1.0, mix.prompt_tokens * (1.0 - mix.cached_fraction))
    shares = [lam_e * u / e.prefill_tokens_per_s if role == "both" else 0.0 for e in engines]
    steps = [e.bare_step_s if role == "prefill" else _step_with_streams(e, lam_e, mix.output_tokens, sh)
             for e, sh in zip(engines, shares)]
    itl = None
    if role != "prefill":
        itl = max(st / (1.0 - sh) if sh < 1.0 else math.inf for st, sh in zip(steps, shares))
    ttft = None
    if role != "decode":
        services = [u / e.prefill_tokens_per_s + math.ceil(u / e.chunk_budget_tokens) * st
                    for e, st in zip(engines, steps)]
        handoff = config.remote_first_token_overhead_s if role == "prefill" else 0.0
        ttft = math.inf if any(math.isinf(s) for s in services) else \
            _queue_ttft(services, arrival_rate, mix.prompt_scv) + handoff
    return PoolPrediction(role, n, ttft, itl, ttft_target_s, config.itl_target_s)


def pool_pressure(engines: Sequence[EngineEstimate], arrival_rate: float, mix: LoadMix,
                  config: PlacementConfig | None = None, down_fraction: float = 0.5) -> ScaleAdvice:
    """Grow the pool whose predicted violation dominates, shrink one that would stay well within targets."""
    if not engines:
        return ScaleAdvice(None, 0, "no_engines", ())
    config = config or PlacementConfig()
    target = ttft_target(max(1, round(mix.prompt_tokens)), engines, config)
    if any(e.role == "prefill" for e in engines):
        groups: list[tuple[Role, list[EngineEstimate]]] = [
            ("prefill", [e for e in engines if e.role in PREFILL_CAPABLE]),
            ("decode", [e for e in engines if e.role in DECODE_CAPABLE])]
    else:  # every engine prefills and decodes; scaled as one count (its role: what the engines are)
        groups = [("both" if all(e.role == "both" for e in engines) else "decode", list(engines))]
    model = {"prefill": "prefill", "decode": "decode"} if len(groups) == 2 else {groups[0][0]: "both"}
    pools = tuple(predict_pool(model[r], es, arrival_rate, mix, config, target) for r, es in groups)
    (label, _), hot = max(zip(groups, pools), key=lambda gp: gp[1].pressure)
    if hot.pressure > 1.0:
        return ScaleAdvice(label, +1, hot.worst, pools)
    shrink: list[tuple[float, Role]] = []
    for (label, es), p in zip(groups, pools):
        if len(es) > 1:
            kept = sorted(es, key=lambda e: e.prefill_tokens_per_s, reverse=True)[:-1]  # drop the slowest
            after = predict_pool(p.role, kept, arrival_rate, mix, config, target)
            if after.pressure < down_fraction:
                shrink.append((after.pressure, label))
    if shrink:
        return ScaleAdvice(min(shrink)[1], -1, "idle", pools)
    return ScaleAdvice(None, 0, "steady", pools)
