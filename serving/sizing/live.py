"""The planner's model at run time (pure): which live pool to grow or shrink by one engine.

The autoscaler (`serving.cluster.autoscaler`) asks `scale_advice` every interval; the shape planner
(`serving.sizing.plan`) asks `simulate` the same question before deployment: one model answers
both. The live pools' rates are what their engines measured of themselves, the workload the
measured arrival rate and mix, the candidates the shape as it is and with one engine more or fewer
in each pool, each simulated step by step with the router's own `place()`. Bounds, delays,
cooldowns and draining stay with the autoscaler (`autoscale_policy.RolePolicy`); a KV pull is
priced by the placement's transfer priors. The steps: `scale_advice`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from serving.placement_config import PlacementConfig
from serving.sizing.profile import EngineProfile, HardwareProfile
from serving.sizing.shapes import Shape
from serving.sizing.simulate import RateResult, ShapeLimits, StepLimits, simulate
from serving.sizing.workload import SloTargets, Workload
from serving.routing.slo_model import EngineEstimate, Role, ttft_target

ADVICE_REQUESTS = 200  # simulated per candidate shape: enough for a p90, a few ms per engine
IDLE_RATE = 1e-3  # req/s simulated when nothing arrives: each request alone on the pool


@dataclass(frozen=True)
class LoadMix:
    """The recent request mix, as the engines saw it (moving averages)."""

    prompt_tokens: float
    output_tokens: float
    cached_fraction: float = 0.0  # share of prompt tokens the prefix caches held


@dataclass(frozen=True)
class LivePool:
    """One role's serving engines and whether the autoscaler's bounds let it change."""

    role: Role
    engines: tuple[EngineEstimate, ...]
    max_seqs: int | None = None  # vLLM's max_num_seqs the role's engines run (None: no cap)
    can_grow: bool = True
    can_shrink: bool = True


@dataclass(frozen=True)
class Outlook:
    """One candidate shape, simulated: its engine counts per role and what its requests saw."""

    counts: tuple[tuple[Role, int], ...]
    result: RateResult
    ttft_target_s: float
    tpot_target_s: float

    @property
    def ttft_ratio(self) -> float:
        return self.result.ttft_p90_s / self.ttft_target_s

    @property
    def tpot_ratio(self) -> float:
        return self.result.tpot_p90_s / self.tpot_target_s

    @property
    def pressure(self) -> float:
        return max(self.ttft_ratio, self.tpot_ratio)

    @property
    def worst(self) -> str:
        return "ttft" if self.ttft_ratio >= self.tpot_ratio else "itl"


@dataclass(frozen=True)
class ScaleAdvice:
    role: Role | None
    delta: int  # +1, -1 or 0
    reason: str  # ttft | itl | idle | steady | no_relief | no_engines
    now: Outlook | None = None  # the shape as it is
    candidates: tuple[tuple[Role, int, Outlook], ...] = field(default=())  # (role, delta, its outlook)


def role_rates(engines: Sequence[EngineEstimate]) -> EngineProfile:
    """A pool's rates: the means of its engines' own (one simulated engine stands for each of them)."""
    return EngineProfile(cores=1, step_s=max(1e-6, statistics.fmean(e.bare_step_s for e in engines)),
                         step_per_stream_s=statistics.fmean(e.step_per_stream_s for e in engines),
                         prefill_tokens_per_s=statistics.fmean(e.prefill_tokens_per_s for e in engines))


def _sim_role(role: Role, present: set[Role]) -> Role:
    """Decode engines without a prefill pool prefill their own prompts: simulated as `both`."""
    return "both" if role == "decode" and "prefill" not in present else role


def _shape(counts: dict[Role, int]) -> Shape | None:
    """The simulated shape of these live counts; None when it cannot serve (no decode-capable engine)."""
    present = {r for r, n in counts.items() if n}
    sim: dict[Role, int] = {}
    for role, n in counts.items():
        sim[_sim_role(role, present)] = sim.get(_sim_role(role, present), 0) + n
    if not (sim.get("both") or sim.get("decode")):
        return None
    return Shape(colocated=(1,) * sim.get("both", 0), prefill=(1,) * sim.get("prefill", 0),
                 decode=(1,) * sim.get("decode", 0))


def scale_advice(pools: Sequence[LivePool], arrival_rate: float, mix: LoadMix, config: PlacementConfig | None = None,
                 down_fraction: float = 0.5, requests: int = ADVICE_REQUESTS) -> ScaleAdvice:
    """Grow the pool whose extra engine relieves a predicted miss most; shrink one that would stay well
    within the targets with one engine fewer.

      1. the live shape   each role's serving engines (`LivePool`); the pool's rates are the means of
                          what its engines measured of themselves (`EngineEstimate`: prefill rate, bare
                          step, growth per stream), its step limits their chunk budget and `max_seqs`
      2. the workload     `requests` requests at the measured arrival rate (Poisson), each with the
                          mix's uncached prompt tokens and its output tokens (`LoadMix`)
      3. the targets      TTFT as placement computes it for the mix's prompt (`ttft_target`), and the
                          placement's `itl_target_s` per output token
      4. the candidates   the shape as it is, with one more engine in each pool that may grow, and with
                          one fewer in each pool that may shrink, each simulated step by step
                          (`simulate`, the router's own `place()` placing requests on `both` engines)
      5. the answer       pressure = the worst of TTFT p90 / its target and TPOT p90 / its target.
                          Above 1: grow the pool whose extra engine brings the pressure lowest, if it
                          lowers it at all (reason: `ttft` or `itl`, the worse ratio now; `no_relief`
                          when none may grow or none would help). Else shrink the pool whose shape with one
                          engine fewer keeps the pressure lowest, if under `down_fraction`. Else `steady`.

    Bounds, delays, cooldowns and draining stay with the autoscaler (`autoscale_policy.RolePolicy`). A
    KV pull between engines is priced by the placement's transfer priors (the autoscaler does not see the
    routers' learned pairs).
    """
    pools = [p for p in pools if p.engines]
    if not pools:
        return ScaleAdvice(None, 0, "no_engines")
    config = config or PlacementConfig()
    every = [e for p in pools for e in p.engines]
    prompt = max(1, round(mix.prompt_tokens * (1.0 - mix.cached_fraction)))
    slo = SloTargets(ttft_target(prompt, every, config), config.itl_target_s)
    rate = max(arrival_rate, IDLE_RATE)
    workload = Workload(prompt_mix=((prompt, 1.0),), output_tokens=max(1, round(mix.output_tokens)), rates=(rate,),
                        requests_per_rate=requests)
    present = {p.role for p in pools}
    by_sim: dict[Role, list[LivePool]] = {}
    for p in pools:
        by_sim.setdefault(_sim_role(p.role, present), []).append(p)
    rates = {r: role_rates([e for p in ps for e in p.engines]) for r, ps in by_sim.items()}
    limits = ShapeLimits(**{r: StepLimits(int(statistics.median(e.chunk_budget_tokens for p in ps for e in p.engines)),
                                          ps[0].max_seqs) for r, ps in by_sim.items()})
    # the profile's own rates are never read (every simulated role has `rates`): only its KV transfer
    profile = HardwareProfile(unit="cpu", total_units=1,
                              engines=(EngineProfile(cores=1, step_s=1.0, step_per_stream_s=0.0,
                                                     prefill_tokens_per_s=1.0),),
                              transfer_tokens_per_s=config.prior_transfer_tokens_per_s,
                              transfer_overhead_s=config.prior_transfer_overhead_s)
    placement = config  # the router's place() splits work between `both` engines (simulate: two or more)

    def outlook(counts: dict[Role, int]) -> Outlook | None:
        shape = _shape(counts)
        if shape is None:
            return None
        result = simulate(shape, profile, workload, rate, slo, limits, placement, rates)
        return Outlook(tuple(sorted(counts.items())), result, slo.ttft_s, slo.tpot_s)

    counts: dict[Role, int] = {p.role: len(p.engines) for p in pools}
    now = outlook(counts)
    assert now is not None  # a deployment always has a decode-capable engine
    candidates: list[tuple[Role, int, Outlook]] = []
    for p in pools:
        for delta, allowed in ((+1, p.can_grow), (-1, p.can_shrink and len(p.engines) > 1)):
            if allowed and (o := outlook({**counts, p.role: counts[p.role] + delta})) is not None:
                candidates.append((p.role, delta, o))
    if now.pressure > 1.0:
        ups = [(o.pressure, -o.result.within_slo, role) for role, delta, o in candidates
               if delta > 0 and o.pressure < now.pressure]  # an engine that would not help is not started
        if ups:
            return ScaleAdvice(min(ups)[2], +1, now.worst, now, tuple(candidates))
        return ScaleAdvice(None, 0, "no_relief", now, tuple(candidates))
    else:
        downs = [(o.pressure, role) for role, delta, o in candidates if delta < 0 and o.pressure < down_fraction]
        if downs:
            return ScaleAdvice(min(downs)[1], -1, "idle", now, tuple(candidates))
    return ScaleAdvice(None, 0, "steady", now, tuple(candidates))

