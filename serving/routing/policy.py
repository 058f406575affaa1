"""Engine scores and the per-request choice between remote and local prefill (pure).

Scores (lower is better), in tokens of work:

  decode engine   cost(d) = cache_weight * (prompt - cached_d) + outstanding_d
  prefill engine  cost(p) = cache_weight * (prompt - cached_p) + queued_p

`cached_x` is the prompt prefix whose KV blocks engine x holds (the prefix index,
fed by the engines' own KV events), `outstanding_d` the tokens a decode engine
still owes (this router's charges: prompt estimate + max_tokens, paid back as
tokens stream), `queued_p` the prompt tokens in flight on a prefill engine.
`cache_weight` says what one prompt token still to compute is worth against one
token of queued work: 0 routes by load alone, large values follow the cache
even onto busy engines. Ties go to fewer requests, then round robin. With
`policy: least_outstanding` nothing is cached as far as scoring knows.

Remote or local prefill (`decide_prefill`), first rule that applies:

  prefix_cached       the part of the prompt the decode engine does not hold
  short_prompt        is below `short_prompt_tokens` -> local (prefix_cached
                      when the decode engine's cache made it short);
  no_prefill_engine   no usable prefill engine (compatible, breaker closed)
                      -> local, or rejected when the fallback is `reject`;
  prefill_saturated   the chosen prefill engine has `prefill_saturation_tokens`
                      queued or more while the decode engine owes fewer than
                      `decode_headroom_tokens` -> local (0 turns the rule off);
  uncached_prompt     otherwise -> remote prefill.

Every decision is counted by the router with its reason
(`raypd_disagg_decisions_total{decision,reason}`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple


class Candidate(NamedTuple):  # built per engine per request: a NamedTuple is the cheapest typed record
    engine_id: str
    cached_tokens: int = 0  # prompt prefix whose blocks the engine holds
    load_tokens: int = 0  # decode: tokens owed; prefill: prompt tokens queued
    requests: int = 0


@dataclass(frozen=True)
class ScoreSettings:
    cache_weight: float = 1.0
    short_prompt_tokens: int = 0
    prefill_saturation_tokens: int = 0
    decode_headroom_tokens: int = 4096


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


@dataclass(frozen=True)
class DisaggDecision:
    decision: Literal["remote", "local", "reject"]
    reason: str

    @property
    def remote(self) -> bool:
        return self.decision == "remote"


def decide_prefill(prompt_tokens: int, decode: Candidate, prefill: Candidate | None, settings: ScoreSettings,
                   fallback_local: bool = True) -> DisaggDecision:
    """Remote or local prefill for one request on `decode` (see the module docstring)."""
    uncached = max(0, prompt_tokens - decode.cached_tokens)
    if uncached < settings.short_prompt_tokens:
        return DisaggDecision("local", "prefix_cached" if decode.cached_tokens else "short_prompt")
    if prefill is None:
        return DisaggDecision("local" if fallback_local else "reject", "no_prefill_engine")
    if (settings.prefill_saturation_tokens and prefill.load_tokens >= settings.prefill_saturation_tokens
            and decode.load_tokens < settings.decode_headroom_tokens):
        return DisaggDecision("local", "prefill_saturated")
    return DisaggDecision("remote", "uncached_prompt")


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
    decision = decide_prefill(prompt_tokens, decode, prefills[0] if prefills else None, settings, fallback_local)
    return Selection(decode, prefills, decision)
