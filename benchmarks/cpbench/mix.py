"""The routing phase's decision mix (pure: no Ray, no asyncio): the turns routed, the faulty pairs, and
what each routed request's path was, counted beside the routing times.

Workload. Every prompt starts with one of the shared system prompts; a long turn adds
`LONG_OWN_TOKENS` tokens of its own, a short turn `SHORT_OWN_TOKENS` (`is_short_turn`: a fixed
share, spread evenly over the requests). The default `slo` placement decides each one: a local
prefill that would stall the decode engine's streams past the ITL target goes to a prefill engine
(`remote/itl_protect`); a short one the decode engine can absorb stays colocated.

Faulty pairs (`FaultyPairs`). The first prefill engine has a faulty pair with a few decode
engines (the SLO model's equal options go to the engine listed first, so these pairs stay in
use). Every prefill of a faulty pair fails: the router retries on another prefill engine and
reports the failure; the coordinator's ledger opens the pair's breaker (threshold), half-opens
it after its cooldown; a request the router plans onto it takes the closed pair ranked next and
the router asks `admit_probe` in the background (serving/routing/probes.py); a later request
carries the granted probe, whose prefill fails, and the breaker opens again (a request awaits the
probe itself only when no closed pair is left to it).

Tally (`tally`). Per measured run: the planner's decisions by (decision, reason), each request's
path as the router served it (`pd`: the first token from a prefill engine; `local`: colocated;
`fallback`: a remote decision with no usable prefill engine), retries, the probes asked, granted,
carried by a request and awaited by one, `pick_prefill` calls, the breakers that opened, and the
routing times per path.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

LONG_OWN_TOKENS = 128  # a long turn: system prompt + 128 tokens (512 in all with a 384-token system prompt)
SHORT_OWN_TOKENS = 32  # a short turn: system prompt + 32 tokens

PD, LOCAL, FALLBACK, ERROR = "pd", "local", "fallback", "error"  # a request's path (`Route.path`), or refused
PD_PROBED, PD_RETRIED = "pd, probe awaited", "pd, first prefill failed"  # subsets of pd, timed on their own


def pct(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (nearest rank); None without samples."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def is_short_turn(i: int, share: float) -> bool:
    """Whether request `i` is a short turn: `share` of the requests, spread evenly (every window of
    1 / share requests holds one)."""
    return math.floor((i + 1) * share) > math.floor(i * share)


def faulty_decodes(decodes: Sequence[str], count: int) -> list[str]:
    """`count` of the decode engines, spread over the list (never more than there are)."""
    count = max(0, min(count, len(decodes)))
    if not count:
        return []
    step = len(decodes) / count
    return [decodes[int(k * step)] for k in range(count)]


class FaultyPairs:
    """The pairs of one prefill engine with some decode engines: every prefill on such a pair fails."""

    def __init__(self, decodes: Iterable[str], prefill_id: str):
        self.pairs = frozenset((d, prefill_id) for d in decodes)  # (decode, prefill)
        self.failed = 0  # prefills failed so far

    def repair(self) -> frozenset[tuple[str, str]]:
        """The pairs work from now on; returns those that were faulty."""
        pairs, self.pairs = self.pairs, frozenset()
        return pairs

    def fails(self, decode_id: str | None, prefill_id: str) -> bool:
        """Whether a prefill on `prefill_id` for `decode_id` fails (None: not known, it does not)."""
        if (decode_id, prefill_id) in self.pairs:
            self.failed += 1
            return True
        return False


@dataclass(frozen=True)
class RoutedPath:
    """How one measured request was routed."""

    path: str  # PD | LOCAL | FALLBACK (the router's `Route.path`), ERROR: refused
    probes: int = 0  # admit_probe calls the request's own task awaited
    attempts: int = 0  # prefill attempts on prefill engines (a retry makes 2)
    routing_ms: float | None = None  # arrival -> its first engine call (None: none was made)


@dataclass(frozen=True)
class PathTimes:
    requests: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None


@dataclass(frozen=True)
class BreakerCount:
    """The pairs' breakers as the router's route table lists them: opens so far, pairs per state."""

    opened: int
    states: dict[str, int]

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, int]]) -> "BreakerCount":
        """From (state, opened_count) per pair."""
        opened, states = 0, Counter()
        for state, count in pairs:
            opened += count
            states[state] += 1
        return cls(opened, dict(states))


@dataclass(frozen=True)
class MixSummary:
    requests: int
    decisions: dict[str, int]  # the planner's, "decision/reason" -> requests
    paths: dict[str, int]  # PD / LOCAL / FALLBACK / ERROR -> requests
    disaggregated_share: float  # of the requests routed: the first token from a prefill engine (PD)
    retried: int  # PD requests whose first prefill failed (served by another prefill engine)
    probe_asks: int  # admit_probe calls awaited by the requests
    probed_requests: int  # requests that awaited at least one
    probes_granted: int
    probes_asked: int  # admit_probe calls in all (most in the background, awaited by no request)
    probes_carried: int  # requests that ran on a half-open pair with the router's grant (the probes)
    pick_prefill_calls: int
    prefills_failed: int  # by the faulty pairs
    breaker_opens: int  # breakers that opened during the run (as the router's table lists them)
    breakers_after: dict[str, int]  # state -> pairs, after the run
    times: dict[str, PathTimes] = field(default_factory=dict)  # path (and PD's subsets) -> routing times


def tally(routed: Sequence[RoutedPath], decisions: Mapping[str, int], pick_prefill_calls: int,
          probes_granted: int, prefills_failed: int, before: BreakerCount, after: BreakerCount,
          probes_asked: int = 0, probes_carried: int = 0) -> MixSummary:
    """One run's mix, from its requests' paths and the run's counter deltas."""
    paths = Counter(r.path for r in routed)
    served = len(routed) - paths[ERROR]
    groups: dict[str, list[float]] = {}
    for r in routed:
        kinds = [r.path] + ([PD_PROBED] if r.path == PD and r.probes else []) + (
            [PD_RETRIED] if r.path == PD and r.attempts > 1 else [])
        for kind in kinds:
            groups.setdefault(kind, [])
            if r.routing_ms is not None:
                groups[kind].append(r.routing_ms)
    times = {k: PathTimes(len(ms), pct(ms, 50), pct(ms, 99), max(ms, default=None)) for k, ms in groups.items()}
    return MixSummary(
        requests=len(routed), decisions={k: v for k, v in decisions.items() if v}, paths=dict(paths),
        disaggregated_share=paths[PD] / served if served else 0.0,
        retried=sum(1 for r in routed if r.path == PD and r.attempts > 1),
        probe_asks=sum(r.probes for r in routed), probed_requests=sum(1 for r in routed if r.probes),
        probes_granted=probes_granted, probes_asked=probes_asked, probes_carried=probes_carried,
        pick_prefill_calls=pick_prefill_calls, prefills_failed=prefills_failed,
        breaker_opens=after.opened - before.opened, breakers_after=after.states, times=times)


def counter_delta(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """after - before, per key (keys that did not move left out)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
