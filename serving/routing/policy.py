"""Engine scores and the per-request choice between remote and local prefill (pure).

Scores (lower is better), in tokens of work (`cost`):

  decode engine   cost(d) = cache_weight * (prompt - cached_d) + outstanding_d
  prefill engine  cost(p) = cache_weight * (prompt - cached_p) + queued_p

`cache_weight` is what one prompt token still to compute is worth against one token of queued work
(0 routes by load alone); ties go to fewer requests, then round robin. With `router.placement:
disaggregate` (`decide_prefill`) a request is prefilled remotely whenever a usable prefill engine
exists; the default placement (`slo`) decides with the SLO model and uses these scores only to pick
a migrated stream's decode engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from serving.routing.decisions import Decision, DecisionReason, DisaggDecision


class Candidate(NamedTuple):  # built per engine per request: a NamedTuple is the cheapest typed record
    engine_id: str
    cached_tokens: int = 0  # prompt prefix whose blocks the engine holds
    load_tokens: int = 0  # decode: tokens owed; prefill: prompt tokens queued
    requests: int = 0


@dataclass(frozen=True)
class ScoreSettings:
    cache_weight: float = 1.0


def cost(c: Candidate, prompt_tokens: int, cache_weight: float) -> float:
    return cache_weight * max(0, prompt_tokens - c.cached_tokens) + c.load_tokens


def rank(candidates: Sequence[Candidate], prompt_tokens: int, cache_weight: float, turn: int = 0
         ) -> list[Candidate]:
    """Best first: lowest cost, then fewest requests, then a rotation (`turn`) among equals."""
    n = max(1, len(candidates))
    return [c for _, c in sorted(((cost(c, prompt_tokens, cache_weight), c.requests, (i - turn) % n), c)
                                 for i, c in enumerate(candidates))]


def best(candidates: Sequence[Candidate], prompt_tokens: int, cache_weight: float, turn: int = 0) -> Candidate:
    """`rank(...)[0]` in one pass (the decode choice needs only the best)."""
    n = max(1, len(candidates))
    return min(((cost(c, prompt_tokens, cache_weight), c.requests, (i - turn) % n), c)
               for i, c in enumerate(candidates))[1]


def decide_prefill(prefill: Candidate | None, fallback_local: bool = True) -> DisaggDecision:
    """Remote prefill whenever a usable prefill engine exists (placement `disaggregate`)."""
    if prefill is None:
        return DisaggDecision(Decision.LOCAL if fallback_local else Decision.REJECT, DecisionReason.NO_PREFILL_ENGINE)
    return DisaggDecision(Decision.REMOTE, DecisionReason.UNCACHED_PROMPT)


@dataclass(frozen=True)
class Selection:
    decode: Candidate
    prefills: tuple[Candidate, ...]  # usable prefill engines for that decode engine, best first
    decision: DisaggDecision


def select(prompt_tokens: int, decodes: Sequence[Candidate], prefills_for: Callable[[str], Sequence[Candidate]],
           settings: ScoreSettings, turn: int = 0, fallback_local: bool = True) -> Selection | None:
    """The decode engine, its prefill engines in order, and remote or local prefill; None without decodes."""
    if not decodes:
        return None
    decode = best(decodes, prompt_tokens, settings.cache_weight, turn)
    # prefill ties keep the given order (the router lists the least busy first); decode ties rotate
    prefills = tuple(rank(prefills_for(decode.engine_id), prompt_tokens, settings.cache_weight))
    decision = decide_prefill(prefills[0] if prefills else None, fallback_local)
    return Selection(decode, prefills, decision)
