"""Where one request goes: the router's hook into cache-aware scoring and conditional disaggregation.

Per request (`RoutePlanner.plan`, called once by `Router.open`):

  1. the router's copy of the prefix index (`PrefixCacheView`, cache-aware
     policy only) is refreshed in the background when older than
     `index_refresh_s`; a request never waits for it (a stale copy costs a
     cache miss at worst, never a wrong answer);
  2. candidates: the live decode engines with the prompt tokens each one's
     prefix cache holds and the tokens this router has charged it; for a decode
     engine, its usable prefill engines (compatible, breaker not open) with
     their cached tokens and queued prompt tokens;
  3. `serving.routing.policy.select` scores them and decides remote or local
     prefill from the tokens the chosen decode engine does not hold;
  4. the decision is counted by (decision, reason), exported as
     `raypd_disagg_decisions_total{decision,reason}`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from actors.protocol import EngineRequest, RouteTable
from serving.config import RouterConfig
from serving.routing.policy import Candidate, DisaggDecision, ScoreSettings, best, select
from serving.routing.pool import EnginePool
from serving.routing.prefix_view import PrefixCacheView
from serving.routing.status import PlannerSnapshot


@dataclass(frozen=True)
class RoutePlan:
    decode_id: str
    prefill_ids: tuple[str, ...]  # usable prefill engines for the decode engine, best first
    decision: DisaggDecision
    cached_tokens: int  # prompt tokens the decode engine's prefix cache holds (as the index knows)


class RoutePlanner:
    def __init__(self, settings: ScoreSettings, view: PrefixCacheView | None = None, fallback_local: bool = True):
        self.settings, self.view, self.fallback_local = settings, view, fallback_local
        self.decisions: Counter[tuple[str, str]] = Counter()  # (decision, reason) -> requests

    def plan(self, pool: EnginePool, req: EngineRequest, routes: RouteTable, turn: int,
             exclude: set[str] = frozenset()) -> RoutePlan | None:
        """The decode engine (not in `exclude`), its prefill engines in order and remote or local
        prefill; None without a live decode engine (nothing counted: the router rejects the request)."""
        live = pool.live_decodes(routes, exclude)
        if not live:
            return None
        # one index lookup (it finds the engines that hold the prompt's blocks, whoever they are); the
        # prefill list is built for the chosen decode engine only (O(decodes + prefills), not their product)
        cached = self._cached(req)
        decodes = self._decode_candidates(pool, live, cached)

        def prefills_for(d: str) -> list[Candidate]:
            loads, held = pool.prefill_load, cached.get
            return [Candidate(p, held(p, 0), (x := loads[p]).tokens, x.requests) for p in pool.usable_prefills(d, routes)]

        sel = select(req.num_prompt_tokens, decodes, prefills_for, self.settings, turn, self.fallback_local)
        self.decisions[(sel.decision.decision, sel.decision.reason)] += 1
        return RoutePlan(sel.decode.engine_id, tuple(p.engine_id for p in sel.prefills), sel.decision,
                         sel.decode.cached_tokens)

    def choose_decode(self, pool: EnginePool, req: EngineRequest, routes: RouteTable, turn: int,
                      exclude: set[str] = frozenset()) -> str | None:
        """The decode engine for a continuation (a migrated stream: no prefill to place), scored
        as a first placement scores decode engines; not counted as a P/D decision."""
        live = pool.live_decodes(routes, exclude)
        if not live:
            return None
        cached = self._cached(req)
        return best(self._decode_candidates(pool, live, cached), req.num_prompt_tokens,
                    self.settings.cache_weight, turn).engine_id

    @staticmethod
    def _decode_candidates(pool: EnginePool, live: list[str], cached: dict[str, int]) -> list[Candidate]:
        loads, held = pool.decode_load, cached.get
        return [Candidate(d, held(d, 0), (x := loads[d]).tokens, x.requests) for d in live]

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


def planner_for(config: RouterConfig, view: PrefixCacheView | None = None) -> RoutePlanner:
    """The planner a router config describes (`view`: the prefix index copy, used when cache-aware)."""
    cache_aware = config.policy == "cache_aware"
    score = ScoreSettings(cache_weight=config.cache_weight if cache_aware else 0.0,
                          short_prompt_tokens=config.short_prompt_tokens,
                          prefill_saturation_tokens=config.prefill_saturation_tokens,
                          decode_headroom_tokens=config.decode_headroom_tokens)
    return RoutePlanner(score, view if cache_aware else None, config.no_prefill_fallback == "decode_local")
