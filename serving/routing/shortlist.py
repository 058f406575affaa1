"""The engines the SLO model is shown at cluster size: the least loaded and those holding most of the prompt.

The SLO model (`serving.routing.slo_model`) predicts every option it is given, decode engines x
prefill engines; at cluster size `serving.routing.placers.SloPlacer` gives it the SHORTLIST least
loaded engines and the SHORTLIST holding most of the prompt (per decode engine, of its prefill
engines): 256 engines took 0.3 s per request unpruned, here O(decodes + prefills).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence, Set as AbstractSet
from typing import Any

from serving.routing.pool import EnginePool

SHORTLIST = 4


def shortlist(ids: list[str], cached: dict[str, int], load: Callable[[str], Any] | None = None,
              k: int = SHORTLIST, keys: Sequence[Any] | None = None) -> list[str]:
    """Of `ids` (in order, least loaded first when neither `load` nor `keys` is given): the `k` least
    loaded and the `k` holding the most cached prompt tokens, in their given order (ties keep the
    caller's rotation). `keys[i]`: the load of `ids[i]`, computed by the caller in one pass."""
    if len(ids) <= k:
        return ids
    if keys is None and load is not None:
        keys = list(map(load, ids))
    # a stable sort of the indexes (C's, not heapq.nsmallest's Python loop): ties keep the given order
    least = sorted(range(len(ids)), key=keys.__getitem__)[:k] if keys is not None else range(k)
    keep = {ids[i] for i in least}
    keep.update(heapq.nlargest(k, (e for e in ids if cached.get(e)), key=cached.__getitem__))
    return [e for e in ids if e in keep]


class PrefillShortlist:
    """`shortlist` of each decode engine's usable prefill engines for one request, from one ranking of
    every prefill engine by load: the least loaded overall that a decode engine may use are its least
    loaded, so each list is a walk down the ranking (O(SHORTLIST) when the pairs are usable), not a
    selection over all its prefill engines (that was O(decodes x prefills) per request)."""

    def __init__(self, pool: EnginePool, cached: dict[str, int], k: int = SHORTLIST):
        self.k, self.cached = k, cached
        ids = list(pool.prefills)
        keys = pool.prefill_keys(ids)
        self.ranked = [ids[i] for i in sorted(range(len(ids)), key=keys.__getitem__)]
        # engines holding some of the prompt, most first (ties: in the index lookup's order)
        self.holders = sorted((e for e in cached if cached[e]), key=cached.__getitem__, reverse=True)

    def of(self, usable: Sequence[str], allowed: AbstractSet[str] | None = None) -> list[str]:
        """The shortlist of `usable` (in its order); `allowed`: the same engines as a set, when the caller has it."""
        if len(usable) <= self.k:
            return list(usable)
        if allowed is None:
            allowed = set(usable)
        keep = set(itertools.islice((p for p in self.ranked if p in allowed), self.k))
        keep.update(itertools.islice((e for e in self.holders if e in allowed), self.k))
        return sorted(keep, key=usable.index)  # at most 2k of them
