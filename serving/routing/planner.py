"""Where one request goes: the decode engine, its prefill engines in order, and colocated or disaggregated.

Per request (`RoutePlanner.plan`, called once by `Router.open`):

  1. the router's copy of the prefix index (`PrefixCacheView`, cache-aware
     policy only) is refreshed in the background when older than
     `index_refresh_s`; a request never waits for it (a stale copy costs a
     cache miss at worst, never a wrong answer);
  2. candidates: the live decode-capable engines (role decode or both) with the
     prompt tokens each one's prefix cache holds; for each, its usable prefill
     engines (role prefill or both, compatible, breaker not open);
  3. placement (`router.placement`):
       slo          (default) `serving.routing.placement` predicts every allowed
                    option's TTFT and the stall it imposes (queued prefill work at
                    each engine's learned rate, its decode streams, the chunked-
                    prefill budget, the pair's pull) and picks the one that keeps
                    TTFT and ITL within their targets at the least cost;
       disaggregate every request is prefilled on a prefill engine when one is
                    usable (`serving.routing.policy` scores the engines);
  4. the decision is counted by (decision, reason), exported as
     `raypd_disagg_decisions_total{decision,reason}`.

Migration (`choose_decode`) scores decode engines as a first placement does. At cluster size the
SLO model sees a shortlist (`shortlist`): the least loaded engines and those holding most of the prompt.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors.protocol import EngineRequest
from actors.routes import RouteTable
from serving.config import RouterConfig
from serving.routing.placement import EngineEstimate, Placement, place
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
    placement: Placement | None = None  # the SLO model's predictions (placement slo)


class RoutePlanner:
    def __init__(self, settings: ScoreSettings, view: PrefixCacheView | None = None, fallback_local: bool = True,
                 config: RouterConfig | None = None, chunk_budgets: dict[str, int] | None = None):
        self.settings, self.view, self.fallback_local = settings, view, fallback_local
        self.config = config or RouterConfig()
        self.chunk_budgets = dict(chunk_budgets or {})  # role -> vLLM's max_num_batched_tokens there
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
        if self.config.placement == "slo":
            plan = self._place(pool, req, live, routes, cached, turn)
        else:  # the prefill list is built for the chosen decode engine only (O(decodes + prefills))
            plan = self._disaggregate(pool, req, live, routes, cached, turn)
        self.decisions[(plan.decision.decision, plan.decision.reason)] += 1
        # the engines that will hold the prompt's KV: the decode engine (it prefills or pulls it) and,
        # disaggregated, the first prefill engine tried
        self.note_held(plan.decode_id, req.prompt_token_ids)
        if plan.decision.remote and plan.prefill_ids:
            self.note_held(plan.prefill_ids[0], req.prompt_token_ids)
        return plan

    def _disaggregate(self, pool: EnginePool, req: EngineRequest, live: list[str], routes: RouteTable,
                      cached: dict[str, int], turn: int) -> RoutePlan:
        def prefills_for(d: str) -> list[Candidate]:
            loads, held = pool.prefill_load, cached.get
            return [Candidate(p, held(p, 0), (x := loads[p]).tokens, x.requests) for p in pool.usable_prefills(d, routes)]

        sel = select(req.num_prompt_tokens, self._decode_candidates(pool, live, cached), prefills_for,
                     self.settings, turn, self.fallback_local)
        return RoutePlan(sel.decode.engine_id, tuple(p.engine_id for p in sel.prefills), sel.decision,
                         sel.decode.cached_tokens)

    def _place(self, pool: EnginePool, req: EngineRequest, live: list[str], routes: RouteTable,
               cached: dict[str, int], turn: int) -> RoutePlan:
        """The SLO model's choice among the allowed (prefill engine or colocated, decode engine) options
        of a shortlist (`shortlist`: all of them in a deployment of a few engines)."""
        n = len(live)
        live = live[turn % n:] + live[:turn % n]  # equal predictions: round robin
        live = shortlist(live, cached, lambda d: ((x := pool.decode_load[d]).requests, x.tokens))
        short = PrefillShortlist(pool, cached)
        prefills_of = {d: short.of(pool.usable_prefills(d, routes, ordered=False)) for d in live}
        ids = list(dict.fromkeys(live + [p for d in live for p in prefills_of[d]]))
        engines = [self.estimate(pool, e, cached.get(e, 0)) for e in ids]
        usable = {d: set(ps) for d, ps in prefills_of.items()}

        def allowed(prefill_id: str | None, decode_id: str) -> bool:
            if decode_id not in usable:
                return False
            if prefill_id is None:
                return self.fallback_local or pool.role_of(decode_id) == "both"
            return prefill_id in usable[decode_id]

        chosen = place(max(1, req.num_prompt_tokens), engines, self.config.slo, pool.rates.transfer, allowed,
                       answer_tokens=req.max_tokens)
        if chosen is None:  # decode engines that may not prefill and no prefill engine: refused
            d = live[0]
            return RoutePlan(d, (), DisaggDecision("reject", "no_prefill_engine"), cached.get(d, 0))
        d = chosen.option.decode_id
        others = [p.option.prefill_id for p in chosen.predictions
                  if p.option.decode_id == d and p.option.prefill_id not in (None, chosen.option.prefill_id)]
        kind, _, why = chosen.reason.partition("/")
        if chosen.option.prefill_id is None:
            return RoutePlan(d, tuple(others), DisaggDecision("local", why), cached.get(d, 0), chosen)
        return RoutePlan(d, (chosen.option.prefill_id, *others), DisaggDecision("remote", why), cached.get(d, 0),
                         chosen)

    def estimate(self, pool: EnginePool, engine_id: str, cached_tokens: int = 0) -> EngineEstimate:
        """One engine as the SLO model sees it: learned rates, what this router has in flight there."""
        role = pool.role_of(engine_id)
        prefill = pool.prefill_load.get(engine_id)
        decode = pool.decode_load.get(engine_id)
        budget = self.chunk_budgets.get(role) or self.config.slo.default_chunk_budget_tokens
        return pool.rates.estimate(engine_id, role, decode_streams=decode.requests if decode else 0,
                                   queued_prefill_tokens=prefill.tokens if prefill else 0,
                                   cached_tokens=cached_tokens, chunk_budget_tokens=budget,
                                   prefill_busy=pool.prefill_busy(engine_id))

    def steps_for(self, pool: EnginePool, engine_id: str, tokens: int) -> int:
        """Engine steps a prefill of `tokens` takes there (its chunked-prefill budget)."""
        return max(1, math.ceil(tokens / self.estimate(pool, engine_id).chunk_budget_tokens))

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


# The SLO model predicts every option it is given, decode engines x prefill engines; at cluster size it
# is given the SHORTLIST least loaded engines and the SHORTLIST holding most of the prompt (per decode
# engine, of its prefill engines): 256 engines took 0.3 s per request unpruned, here O(decodes + prefills).
SHORTLIST = 4


def shortlist(ids: list[str], cached: dict[str, int], load: Callable[[str], Any] | None = None,
              k: int = SHORTLIST) -> list[str]:
    """Of `ids` (in order, least loaded first when `load` is None): the `k` least loaded and the `k`
    holding the most cached prompt tokens, in their given order (ties keep the caller's rotation)."""
    if len(ids) <= k:
        return ids
    keep = set(heapq.nsmallest(k, ids, key=load) if load is not None else ids[:k])
    keep.update(heapq.nlargest(k, (e for e in ids if cached.get(e)), key=cached.__getitem__))
    return [e for e in ids if e in keep]


class PrefillShortlist:
    """`shortlist` of each decode engine's usable prefill engines for one request, from one ranking of
    every prefill engine by load: the least loaded overall that a decode engine may use are its least
    loaded, so each list is a walk down the ranking (O(SHORTLIST) when the pairs are usable), not a
    selection over all its prefill engines (that was O(decodes x prefills) per request)."""

    def __init__(self, pool: EnginePool, cached: dict[str, int], k: int = SHORTLIST):
        self.k, self.cached = k, cached
        self.ranked = sorted(pool.prefills, key=pool.prefill_order)
        # engines holding some of the prompt, most first (ties: in the index lookup's order)
        self.holders = sorted((e for e in cached if cached[e]), key=cached.__getitem__, reverse=True)

    def of(self, usable: list[str]) -> list[str]:
        if len(usable) <= self.k:
            return usable
        allowed = set(usable)
        keep = set(itertools.islice((p for p in self.ranked if p in allowed), self.k))
        keep.update(itertools.islice((e for e in self.holders if e in allowed), self.k))
        return [e for e in usable if e in keep]


def planner_for(config: RouterConfig, view: PrefixCacheView | None = None,
                chunk_budgets: dict[str, int] | None = None) -> RoutePlanner:
    """The planner a router config describes (`view`: the prefix index copy, used when cache-aware;
    `chunk_budgets`: each role's chunked-prefill budget, as the engines were started with)."""
    cache_aware = config.policy == "cache_aware"
    score = ScoreSettings(cache_weight=config.cache_weight if cache_aware else 0.0)
    return RoutePlanner(score, view if cache_aware else None, config.no_prefill_fallback == "decode_local",
                        config, chunk_budgets)
