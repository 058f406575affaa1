"""Where one request goes: the decode engine, its prefill engines in order, and colocated or disaggregated.

`RoutePlanner.plan` (called once by `Router.open`) lists the candidates (live decode-capable engines
with the prompt tokens each one's prefix cache holds, and their usable prefill engines) and asks the
`Placer` that `router.placement` names (`serving.routing.placers`: the SLO model by default); every
decision is counted by (decision, reason) (`raypd_disagg_decisions_total`). Invariant: a request
never waits for the prefix index (its copy is refreshed in the background; a stale copy costs a
cache miss at worst, never a wrong answer). Migration (`choose_decode`) goes through the same
placer. The steps of one plan: `RoutePlanner`.
"""

from __future__ import annotations

from collections import Counter

from actors.protocol.request import EngineRequest
from actors.routes import RouteTable
from serving.config import RouterConfig
from serving.routing.slo_model import EngineEstimate
from serving.routing.placers import EngineEstimates, Placer, RoutePlan, placer_for
from serving.routing.policy import ScoreSettings
from serving.routing.pool import EnginePool
from serving.routing.prefix_view import PrefixCacheView
from serving.routing.status import PlannerSnapshot


class RoutePlanner:
    """Per request (`RoutePlanner.plan`, called once by `Router.open`):

      1. the router's copy of the prefix index (`PrefixCacheView`, cache-aware
         policy only) is refreshed in the background when older than
         `index_refresh_s`; a request never waits for it (a stale copy costs a
         cache miss at worst, never a wrong answer);
      2. candidates: the live decode-capable engines (role decode or both) with the
         prompt tokens each one's prefix cache holds; for each, its usable prefill
         engines (role prefill or both, compatible, breaker not open);
      3. placement: the `Placer` that `router.placement` names (`serving.routing.placers`,
         chosen once, by `placer_for`, when the planner is built):
           slo          (default, `SloPlacer`) `serving.routing.slo_model` predicts every
                        allowed option's TTFT and the stall it imposes (queued prefill work
                        at each engine's own published rate, its decode streams, the chunked-
                        prefill budget, the pair's pull) and picks the one that keeps
                        TTFT and ITL within their targets at the least cost;
           disaggregate (`DisaggregatePlacer`) every request is prefilled on a prefill
                        engine when one is usable (`serving.routing.policy` scores the engines);
      4. the decision is counted by (decision, reason), exported as
         `raypd_disagg_decisions_total{decision,reason}`.

    Migration (`choose_decode`) goes through the same placer as a first placement (`Placer.continuation`). At cluster size the
    SLO model sees a shortlist (`serving.routing.shortlist`): the least loaded engines and those holding
    most of the prompt.
    """

    def __init__(self, settings: ScoreSettings, view: PrefixCacheView | None = None, fallback_local: bool = True,
                 config: RouterConfig | None = None, chunk_budgets: dict[str, int] | None = None):
        self.settings, self.view, self.fallback_local = settings, view, fallback_local
        self.config = config or RouterConfig()
        # chunk_budgets: role -> vLLM's max_num_batched_tokens there (the SLO model's step sizes)
        self.estimates = EngineEstimates(self.config.slo, chunk_budgets)
        self.placer: Placer = placer_for(self.config.placement, settings, self.estimates, fallback_local)
        self.decisions: Counter[tuple[str, str]] = Counter()  # (decision, reason) -> requests

    def plan(self, pool: EnginePool, req: EngineRequest, routes: RouteTable, turn: int,
             exclude: set[str] = frozenset()) -> RoutePlan | None:
        """The decode engine (not in `exclude`), its prefill engines in order and colocated or
        disaggregated; None without a live decode engine (nothing counted: the router rejects it)."""
        live = pool.live_decodes(routes, exclude)
        if not live:
            return None
        # one index lookup (it finds the engines that hold the prompt's blocks, whoever they are)
        cached = self._cached(req)
        plan = self.placer.place(pool, req, live, routes, cached, turn)
        self.decisions[(plan.decision.decision, plan.decision.reason)] += 1
        # the engines that will hold the prompt's KV: the decode engine (it prefills or pulls it) and,
        # disaggregated, the first prefill engine tried
        self.note_held(plan.decode_id, req.prompt_token_ids)
        if plan.decision.remote and plan.prefill_ids:
            self.note_held(plan.prefill_ids[0], req.prompt_token_ids)
        return plan

    def estimate(self, pool: EnginePool, engine_id: str, cached_tokens: int = 0) -> EngineEstimate:
        """One engine as the SLO model sees it: its own published rates and queues, and this router's load there."""
        return self.estimates.of(pool, engine_id, cached_tokens)

    def choose_decode(self, pool: EnginePool, req: EngineRequest, routes: RouteTable, turn: int,
                      exclude: set[str] = frozenset()) -> str | None:
        """The decode engine for a continuation (a migrated stream: it recomputes there), chosen by
        the placer that places first requests (the SLO model's `place()` by default); not counted as
        a P/D decision."""
        live = pool.live_decodes(routes, exclude)
        if not live:
            return None
        return self.placer.continuation(pool, req, live, self._cached(req), turn)

    def note_held(self, engine_id: str | None, token_ids: tuple[int, ...]) -> None:
        """`engine_id` caches `token_ids` now (a placement of this router, or an answer it streamed)."""
        if self.view is not None and engine_id is not None and token_ids:
            self.view.note_held(engine_id, token_ids)

    def _cached(self, req: EngineRequest) -> dict[str, int]:
        """Engine -> prompt tokens its prefix cache holds (engines left out hold none)."""
        if self.view is None or not req.prompt_token_ids:
            return {}
        self.view.refresh_soon()
        return self.view.held_tokens(req.prompt_token_ids)

    def snapshot(self) -> PlannerSnapshot:
        return PlannerSnapshot(dict(self.decisions),
                               self.view.index.engines() if self.view is not None else None,
                               self.view.error if self.view is not None else None)


def planner_for(config: RouterConfig, view: PrefixCacheView | None = None,
                chunk_budgets: dict[str, int] | None = None) -> RoutePlanner:
    """The planner a router config describes (`view`: the prefix index copy, used when cache-aware;
    `chunk_budgets`: each role's chunked-prefill budget, as the engines were started with)."""
    cache_aware = config.policy == "cache_aware"
    score = ScoreSettings(cache_weight=config.cache_weight if cache_aware else 0.0)
    return RoutePlanner(score, view if cache_aware else None, config.no_prefill_fallback == "decode_local",
                        config, chunk_budgets)
