"""Every shape a box allows, simulated at every rate of the workload; the one with the most goodput.

  plan(profile, workload, slo, base) -> Plan   each shape's `ShapePrediction`, the chosen one
  render_table(plan) -> str                    one row per shape: goodput per rate, the chosen one marked

Each shape runs as raypd would run it from `base` (a deployment file's mapping): the step limits of
its engines and the targets its router places against come from the deployment the shape makes
(deployment.shape_limits, deployment.slo_targets), so what is predicted is what `deployment_yaml` of
the chosen shape and budget deploys. Each shape is simulated with every chunk budget of
`deployment.budget_choices` on its decode-capable engines (a budget the operator wrote is the only
one) and keeps its best. The choice: the highest goodput summed over the rates; ties go to fewer
engines, then to colocated, then to the lower median TTFT, then to the deployment's own budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from serving.config import ConfigError
from serving.sizing.deployment import budget_choices, deployment_config, shape_limits
from serving.sizing.profile import HardwareProfile
from serving.sizing.shapes import Shape, enumerate_shapes
from serving.sizing.simulate import RateResult, simulate
from serving.sizing.workload import Request, SloTargets, Workload


@dataclass(frozen=True)
class ShapePrediction:
    shape: Shape
    results: tuple[RateResult, ...]  # one per rate of the workload, in its order
    measured: bool  # False: some engine size's rates were extrapolated (HardwareProfile.for_size)
    budget: int | None = None  # the chunk budget written for its decode-capable engines (None: the deployment's own)
    budget_tokens: int = 0  # the budget its decode-capable engines run with, either way

    @property
    def total_goodput(self) -> float:
        return sum(r.goodput for r in self.results)

    def rank(self) -> tuple[float, int, bool, float, bool, str]:
        """Sort key, best first (goodput rounded: sums of equal counts must tie exactly; TTFT to the
        millisecond, so that a budget wins on a difference a client can see)."""
        median_ttft = round(sum(r.ttft_p50_s for r in self.results) / len(self.results), 3)
        return (-round(self.total_goodput, 9), self.shape.engines, not self.shape.is_colocated, median_ttft,
                self.budget is not None, self.shape.label)


@dataclass(frozen=True)
class RefusedShape:
    shape: Shape
    reason: str  # why raypd's config refuses it (ConfigError's message)


@dataclass(frozen=True)
class Plan:
    profile: HardwareProfile
    workload: Workload
    slo: SloTargets
    predictions: tuple[ShapePrediction, ...]  # enumerate_shapes' order
    chosen: ShapePrediction
    refused: tuple[RefusedShape, ...] = ()


def plan(profile: HardwareProfile, workload: Workload, slo: SloTargets, base: Mapping[str, Any] | None = None,
         sizes: tuple[int, ...] | None = None, arrivals: Mapping[float, Sequence[Request]] | None = None,
         budgets: tuple[int | None, ...] | None = None) -> Plan:
    """Simulate every shape of `profile`'s box with engine `sizes` (default: the measured ones) at
    every rate of `workload`, each as a deployment made from `base` (default: raypd's defaults) with
    each of its `budget_choices` (`budgets`: these instead); shapes raypd's config refuses are left
    out and listed in `Plan.refused`. `arrivals`: per rate, the requests to simulate instead of the
    workload's own draw (a benchmark's very requests)."""
    base = base or {}
    predictions, refused = [], []
    for shape in enumerate_shapes(profile.total_units, sizes or profile.sizes):
        try:
            own = deployment_config(shape, base, profile.unit, slo)
            tried = [_predict(shape, profile, workload, slo, base, budget, arrivals)
                     for budget in (budgets or budget_choices(own, profile.unit))]
        except ConfigError as exc:
            refused.append(RefusedShape(shape, str(exc)))
            continue
        predictions.append(min(tried, key=ShapePrediction.rank))
    if not predictions:
        raise ValueError("no shape of this profile makes a valid deployment: "
                         + "; ".join(f"{r.shape.label}: {r.reason}" for r in refused))
    return Plan(profile=profile, workload=workload, slo=slo, predictions=tuple(predictions),
                chosen=min(predictions, key=ShapePrediction.rank), refused=tuple(refused))


def _predict(shape: Shape, profile: HardwareProfile, workload: Workload, slo: SloTargets, base: Mapping[str, Any],
             budget: int | None, arrivals: Mapping[float, Sequence[Request]] | None) -> ShapePrediction:
    cfg = deployment_config(shape, base, profile.unit, slo, budget)
    limits = shape_limits(cfg, profile.unit)
    placement = cfg.router.slo if cfg.router.placement == "slo" else None  # the router's model places
    results = tuple(simulate(shape, profile, workload, rate, slo, limits, placement,
                             requests=(arrivals or {}).get(rate)) for rate in workload.rates)
    sizes_used = {*shape.colocated, *shape.prefill, *shape.decode}
    decode_limits = limits.both if shape.colocated else limits.decode
    return ShapePrediction(shape, results, all(profile.for_size(k).measured for k in sizes_used), budget,
                           decode_limits.budget_tokens)


def render_table(result: Plan) -> str:
    """Fixed-width text: the targets and workload, then one row per shape (best first) with its
    goodput at each rate and in total, and the fraction of requests within the targets; `>` marks
    the chosen shape, `~` a shape with an extrapolated engine size."""
    w, slo = result.workload, result.slo
    mix = ", ".join(f"{t} ({s:g})" for t, s in w.prompt_mix)
    lines = [f"predicted goodput (req/s within TTFT {slo.ttft_s:g} s and TPOT {slo.tpot_s:g} s; "
             f"{w.requests_per_rate} requests per rate, prompt tokens {mix}, {w.output_tokens} output tokens; "
             f"{result.profile.total_units} {result.profile.unit} units)"]
    rate_cols = [f"{r:g}/s" for r in w.rates]
    width = max(len(p.shape.label) for p in result.predictions) + 2
    header = (f"  {'shape':<{width}}{'units':>5}{'budget':>7}" + "".join(f"{c:>9}" for c in rate_cols)
              + f"{'total':>9}{'in SLO':>8}")
    lines += [header, "  " + "-" * (len(header) - 2)]
    for p in sorted(result.predictions, key=ShapePrediction.rank):
        mark = ">" if p is result.chosen else " "
        label = p.shape.label + ("" if p.measured else " ~")
        share = sum(r.within_slo for r in p.results) / sum(r.requests for r in p.results)
        budget = f"{p.budget_tokens}" + ("*" if p.budget is not None else "")
        lines.append(f"{mark} {label:<{width}}{p.shape.units:>5}{budget:>7}" + "".join(f"{r.goodput:>9.3f}" for r in p.results)
                     + f"{p.total_goodput:>9.3f}{share:>8.0%}")
    chosen = result.chosen
    lines.append(f"chosen: {chosen.shape.label}" + (f", max_num_batched_tokens {chosen.budget}" if chosen.budget else ""))
    lines.append("budget: the decode-capable engines' max_num_batched_tokens; * the plan's (each shape is tried with "
                 "every budget the planner may choose and shown with its best), else the deployment's own")
    if not result.chosen.total_goodput:
        lines.append("no shape meets the targets at these rates: loosen the targets, lower the rates or add units")
    if not all(p.measured for p in result.predictions):
        lines.append("~ an engine size not in the profile: its prefill rate scaled from the nearest measured size")
    lines += [f"refused by raypd's config: {r.shape.label}: {r.reason}" for r in result.refused]
    return "\n".join(lines) + "\n"
