"""Colocated or disaggregated, and on which engines: the two placements `router.placement` names.

Both are a `Placer` (one request's `RoutePlan` from the live decode engines and what their
prefix caches hold); `placer_for` is the one place the placement is chosen, and the
`RoutePlanner` (`serving.routing.planner`) holds the placer it returns:

  `SloPlacer`           placement "slo" (the default): the SLO model (`serving.routing.slo_model`)
                        predicts every allowed option's TTFT and the stall it imposes and picks
                        the one that keeps TTFT and ITL within their targets at the least cost,
                        colocated (local) or disaggregated (remote);
  `DisaggregatePlacer`  placement "disaggregate": the engines' scores (`serving.routing.policy`)
                        pick the decode engine, and its prompt is prefilled remotely whenever a
                        prefill engine is usable with it.
  `SloPlacer(local_only)` placement "colocate": the SLO model among the colocated options alone
                        (no KV pulled; the baseline a slow link's pulls are measured against).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from actors.protocol.request import EngineRequest
from actors.routes import RouteTable
from serving.placement_config import PlacementConfig
from serving.routing.slo_model import EngineEstimate, Placement, place
from serving.routing.decisions import Decision, DecisionReason, DisaggDecision
from serving.routing.policy import Candidate, ScoreSettings, best, select
from serving.routing.pool import EnginePool
from serving.routing.shortlist import PrefillShortlist, shortlist


@dataclass(frozen=True)
class RoutePlan:
    decode_id: str
    prefill_ids: tuple[str, ...]  # usable prefill engines for the decode engine, best first
    decision: DisaggDecision
    cached_tokens: int  # prompt tokens the decode engine's prefix cache holds (as the index knows)
    placement: Placement | None = None  # the SLO model's predictions (placement slo)


class Placer(Protocol):
    def place(self, pool: EnginePool, req: EngineRequest, live: list[str], routes: RouteTable,
              cached: dict[str, int], turn: int) -> RoutePlan:
        """The plan of `req` among the `live` decode engines (never empty); `cached`: engine -> prompt
        tokens its prefix cache holds; `turn`: this request's turn (equal choices go round robin)."""
        ...

    def continuation(self, pool: EnginePool, req: EngineRequest, live: list[str], cached: dict[str, int],
                     turn: int) -> str:
        """The decode engine among `live` (never empty) for a migrated stream's continuation: it
        recomputes prompt + streamed tokens there (colocated), by the same policy as a first placement."""
        ...


def decode_candidates(pool: EnginePool, live: list[str], cached: dict[str, int]) -> list[Candidate]:
    """The live decode engines as the scoring policy sees them (what they hold, what they owe)."""
    loads, held = pool.decode_load, cached.get
    return [Candidate(d, held(d, 0), (x := loads[d]).tokens, x.requests) for d in live]


class EngineEstimates:
    """Engines as the SLO model sees them: their own published rates and queues, what this router has
    in flight there, and each role's chunked-prefill budget (as configured; an engine's own wins)."""

    def __init__(self, slo: PlacementConfig, chunk_budgets: dict[str, int] | None = None):
        self.slo = slo
        self.chunk_budgets = dict(chunk_budgets or {})  # role -> vLLM's max_num_batched_tokens there

    def of(self, pool: EnginePool, engine_id: str, cached_tokens: int = 0) -> EngineEstimate:
        role = pool.role_of(engine_id)
        prefill = pool.prefill_load.get(engine_id)
        decode = pool.decode_load.get(engine_id)
        budget = self.chunk_budgets.get(role) or self.slo.chunk_budget_fallback()
        return pool.rates.estimate(engine_id, role, decode_streams=decode.requests if decode else 0,
                                   queued_prefill_tokens=prefill.tokens if prefill else 0,
                                   cached_tokens=cached_tokens, chunk_budget_tokens=budget,
                                   prefill_busy=pool.prefill_busy(engine_id),
                                   fresh_streams=decode.fresh if decode else 0)


class DisaggregatePlacer:
    """Placement "disaggregate": the best-scored decode engine, prefilled on a prefill engine when
    one is usable with it (`serving.routing.policy.select`; local only as its fallback)."""

    def __init__(self, settings: ScoreSettings, fallback_local: bool):
        self.settings, self.fallback_local = settings, fallback_local

    def place(self, pool: EnginePool, req: EngineRequest, live: list[str], routes: RouteTable,
              cached: dict[str, int], turn: int) -> RoutePlan:
        # the prefill list is built for the chosen decode engine only (O(decodes + prefills))
        def prefills_for(d: str) -> list[Candidate]:
            loads, held = pool.prefill_load, cached.get
            return [Candidate(p, held(p, 0), (x := loads[p]).tokens, x.requests) for p in pool.usable_prefills(d, routes)]

        sel = select(req.num_prompt_tokens, decode_candidates(pool, live, cached), prefills_for,
                     self.settings, turn, self.fallback_local)
        return RoutePlan(sel.decode.engine_id, tuple(p.engine_id for p in sel.prefills), sel.decision,
                         sel.decode.cached_tokens)


    def continuation(self, pool: EnginePool, req: EngineRequest, live: list[str], cached: dict[str, int],
                     turn: int) -> str:
        return best(decode_candidates(pool, live, cached), req.num_prompt_tokens, self.settings.cache_weight,
                    turn).engine_id


class SloPlacer:
    """Placement "slo": the SLO model's choice among the allowed (prefill engine or colocated, decode
    engine) options of a shortlist (`serving.routing.shortlist`: all of them in a deployment of a few engines)."""

    def __init__(self, estimates: EngineEstimates, fallback_local: bool, local_only: bool = False):
        self.estimates, self.fallback_local, self.local_only = estimates, fallback_local, local_only

    def place(self, pool: EnginePool, req: EngineRequest, live: list[str], routes: RouteTable,
              cached: dict[str, int], turn: int) -> RoutePlan:
        n = len(live)
        live = live[turn % n:] + live[:turn % n]  # equal predictions: round robin
        live = shortlist(live, cached, keys=pool.decode_keys(live))
        short = PrefillShortlist(pool, cached)
        prefills_of = {d: short.of(*pool.usable_prefill_set(d, routes)) for d in live}
        ids = list(dict.fromkeys(live + [p for d in live for p in prefills_of[d]]))
        engines = [self.estimates.of(pool, e, cached.get(e, 0)) for e in ids]
        usable = {d: set(ps) for d, ps in prefills_of.items()}

        def allowed(prefill_id: str | None, decode_id: str) -> bool:
            if decode_id not in usable:
                return False
            if prefill_id is None:
                return self.fallback_local or pool.role_of(decode_id) == "both"
            return not self.local_only and prefill_id in usable[decode_id]

        chosen = place(max(1, req.num_prompt_tokens), engines, self.estimates.slo, pool.rates.transfer, allowed,
                       answer_tokens=req.max_tokens)
        if chosen is None:  # decode engines that may not prefill and no prefill engine: refused
            d = live[0]
            return RoutePlan(d, (), DisaggDecision(Decision.REJECT, DecisionReason.NO_PREFILL_ENGINE), cached.get(d, 0))
        d = chosen.option.decode_id
        others = [p.option.prefill_id for p in chosen.predictions
                  if p.option.decode_id == d and p.option.prefill_id not in (None, chosen.option.prefill_id)]
        if chosen.option.prefill_id is None:
            why = DecisionReason.COLOCATE if self.local_only else chosen.why
            return RoutePlan(d, tuple(others), DisaggDecision(Decision.LOCAL, why), cached.get(d, 0), chosen)
        return RoutePlan(d, (chosen.option.prefill_id, *others), DisaggDecision(Decision.REMOTE, chosen.why),
                         cached.get(d, 0),
                         chosen)


    def continuation(self, pool: EnginePool, req: EngineRequest, live: list[str], cached: dict[str, int],
                     turn: int) -> str:
        """The SLO model's colocated option with the least predicted cost (the continuation's TTFT and
        the stall its recompute imposes on the engine's streams), as `place` ranks first placements."""
        n = len(live)
        live = live[turn % n:] + live[:turn % n]  # equal predictions: round robin
        live = shortlist(live, cached, keys=pool.decode_keys(live))
        engines = [self.estimates.of(pool, d, cached.get(d, 0)) for d in live]
        chosen = place(max(1, req.num_prompt_tokens), engines, self.estimates.slo, pool.rates.transfer,
                       lambda prefill_id, decode_id: prefill_id is None, answer_tokens=req.max_tokens)
        return chosen.option.decode_id if chosen is not None else live[0]


def placer_for(placement: str, settings: ScoreSettings, estimates: EngineEstimates, fallback_local: bool) -> Placer:
    """The placer `router.placement` names: the one place the placement is chosen (`settings`: the
    scoring policy's; `fallback_local`: a decode engine may prefill itself when no prefill engine is usable)."""
    if placement == "slo":
        return SloPlacer(estimates, fallback_local)
    if placement == "disaggregate":
        return DisaggregatePlacer(settings, fallback_local)
    if placement == "colocate":
        return SloPlacer(estimates, fallback_local, local_only=True)
    raise ValueError(f"unknown router.placement {placement!r} (slo, disaggregate or colocate)")
