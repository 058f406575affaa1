"""Outcomes of requests under a fault, and their per-phase aggregation (benchmarks/faults.py).

Pure: a `Stream` (what the client saw of one request) and its reference text in, an outcome
out; outcomes and the phase's fault times in, the phase's figures out.

Outcomes (one per request):
  right  HTTP 200, the stream ended with [DONE], no error event, text == the reference
  wrong  HTTP 200, ended with [DONE], no error event, text != the reference
  tie    the same, but the first differing token is at a near tie of the reference's top two
         (<= 0.05 nats; pdbench/fault_ties.py): CPU kernels are not batch-invariant
  cut    the stream ended without [DONE] and without an error event, or the transport failed
         (before or after the response headers; `detail` says which)
  hung   no terminal outcome within the request limit (120 s)
  error  a clean error: an HTTP error status, or an error event in the stream
"""

from __future__ import annotations

from dataclasses import dataclass, field

RIGHT, WRONG, TIE, CUT, HUNG, ERROR = "right", "wrong", "tie", "cut", "hung", "error"
OUTCOMES = (RIGHT, WRONG, TIE, CUT, HUNG, ERROR)


@dataclass
class Stream:
    """What the client saw of one streamed request (times in s from the phase's start)."""

    idx: int
    sent_s: float
    status: int | None = None  # HTTP status, None when no response came
    text: str = ""
    done: bool = False  # `data: [DONE]` seen
    error_event: str | None = None  # the first `data: {"error": ...}` event
    transport_error: str | None = None  # the connection or the read failed
    timed_out: bool = False  # no terminal outcome within the limit
    end_s: float | None = None  # when the outcome was known

    def to_json(self) -> dict:
        return dict(vars(self))


@dataclass(frozen=True)
class Outcome:
    idx: int
    kind: str  # one of OUTCOMES
    sent_s: float
    end_s: float | None
    detail: str = ""


def complete(s: Stream) -> bool:
    """A 200 answer that ended with [DONE] and no error event (right, wrong or a near tie)."""
    return (not s.timed_out and s.status == 200 and s.error_event is None and s.transport_error is None
            and s.done)


def classify(s: Stream, reference: str, tie_gap: float | None = None, near_tie: float = 0.05) -> Outcome:
    """`tie_gap`: the reference's top-two gap at the first differing token, where it was computed."""
    def out(kind: str, detail: str = "") -> Outcome:
        return Outcome(s.idx, kind, s.sent_s, s.end_s, detail)

    if s.timed_out:
        return out(HUNG, f"no outcome within the limit ({len(s.text)} chars streamed)")
    if s.status is not None and s.status != 200:
        return out(ERROR, f"HTTP {s.status}")
    if s.error_event is not None:
        return out(ERROR, f"error event: {s.error_event[:120]}")
    if s.transport_error is not None:
        where = "before a response" if s.status is None else f"after {len(s.text)} chars"
        return out(CUT, f"transport failed {where}: {s.transport_error[:120]}")
    if not s.done:
        return out(CUT, f"ended without [DONE] after {len(s.text)} chars")
    if s.text == reference:
        return out(RIGHT)
    where = f"differs from char {first_difference(s.text, reference)}"
    if tie_gap is not None and tie_gap <= near_tie:
        return out(TIE, f"{where}, top-two gap {tie_gap} nats")
    return out(WRONG, where + ("" if tie_gap is None else f", top-two gap {tie_gap} nats"))


def first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@dataclass(frozen=True)
class Window:
    """The phase's fault: injected at `fault_s`, its window ends at `until_s` (SIGCONT, or a fixed
    span after a kill); `end_s` is the end of the phase (the last outcome known)."""

    fault_s: float
    until_s: float
    end_s: float


@dataclass
class PhaseFigures:
    sent: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {k: 0 for k in OUTCOMES})
    wrong_rate: float = 0.0  # wrong / the 200 answers that ended with [DONE] (near ties not wrong)
    goodput_during: float = 0.0  # right answers (near ties included) completed in [fault, until] per second
    goodput_after: float = 0.0  # right answers completed after `until` per second (to the phase end)
    goodput_before: float = 0.0  # right answers completed before the fault per second
    first_good_s: float | None = None  # fault -> first right answer of a request sent at/after the fault
    details: dict[str, list[str]] = field(default_factory=dict)  # outcome -> a few details

    def to_json(self) -> dict:
        return dict(vars(self))


def _rate(n: int, span: float) -> float:
    return round(n / span, 4) if span > 0 else 0.0


def aggregate(outcomes: list[Outcome], w: Window, keep_details: int = 3) -> PhaseFigures:
    f = PhaseFigures(sent=len(outcomes))
    for o in outcomes:
        f.counts[o.kind] += 1
        if o.detail and len(f.details.setdefault(o.kind, [])) < keep_details:
            f.details[o.kind].append(f"#{o.idx}: {o.detail}")
    answered = f.counts[RIGHT] + f.counts[WRONG] + f.counts[TIE]
    f.wrong_rate = round(f.counts[WRONG] / answered, 4) if answered else 0.0
    right = [o for o in outcomes if o.kind in (RIGHT, TIE) and o.end_s is not None]  # the near-tie rule
    f.goodput_before = _rate(sum(o.end_s < w.fault_s for o in right), w.fault_s)
    f.goodput_during = _rate(sum(w.fault_s <= o.end_s < w.until_s for o in right), w.until_s - w.fault_s)
    f.goodput_after = _rate(sum(o.end_s >= w.until_s for o in right), w.end_s - w.until_s)
    after = [o.end_s for o in right if o.sent_s >= w.fault_s]
    f.first_good_s = round(min(after) - w.fault_s, 2) if after else None
    return f


def bad_of_raypd(figures: dict[str, dict[str, PhaseFigures]], raypd_setups: set[str]) -> list[str]:
    """The benchmark's own check: every wrong answer, cut stream or hung request of raypd's set-ups."""
    out = []
    for setup, phases in figures.items():
        if setup not in raypd_setups:
            continue
        for phase, f in phases.items():
            bad = {k: f.counts[k] for k in (WRONG, CUT, HUNG) if f.counts[k]}
            if bad:
                out.append(f"{setup} {phase}: {bad}")
    return out


def false_kills(trail_entries: list[dict], stop_phases: set[str]) -> float:
    """Hang kills counted in phases that stopped no engine (a SIGSTOP phase may kill the stopped one)."""
    return sum(e.get("counts", {}).get("hang_kills", 0.0) for e in trail_entries if e.get("phase") not in stop_phases)
