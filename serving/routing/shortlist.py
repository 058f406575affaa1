"""The engines the SLO model is shown at cluster size: the least loaded and those holding most of the prompt.

The SLO model (`serving.routing.placement`) predicts every option it is given, decode engines x
prefill engines; at cluster size `serving.routing.placers.SloPlacer` gives it the SHORTLIST least
loaded engines and the SHORTLIST holding most of the prompt (per decode engine, of its prefill
engines): 256 engines took 0.3 s per request unpruned, here O(decodes + prefills).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

from serving.routing.pool import EnginePool

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
