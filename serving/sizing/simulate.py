"""One shape under one workload at one rate, simulated step by step: what each request would see.

The engine model is vLLM's continuous batching with chunked prefill, costed by the product's one
linear rate model (`actors.rates`); requests are placed as raypd's router places them (the
product's own `place()` on colocated shapes), so the simulation and the service cannot disagree
on placement. `StepLimits` / `ShapeLimits` are what a step may carry on each role's engines
(vLLM's max_num_batched_tokens and max_num_seqs). Its cost grows with requests and prefill steps,
not with output tokens (runs of decode-only steps advance in one event). The model, the placement
and the speed-up: `simulate`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from serving.placement_config import PlacementConfig
from serving.sizing.profile import EngineProfile, HardwareProfile
from serving.sizing.shapes import Shape
from serving.sizing.workload import Request, SloTargets, Workload
from serving.routing.slo_model import EngineEstimate, TransferEstimate, place
from serving.routing.pool import GivenRate
from serving.routing.shortlist import shortlist

DEFAULT_BUDGET_TOKENS = 2048  # vLLM's max_num_batched_tokens when nothing sets it


@dataclass(frozen=True)
class StepLimits:
    budget_tokens: int = DEFAULT_BUDGET_TOKENS  # tokens a step may carry: decodes + prompt chunks
    max_seqs: int | None = None  # requests a step may carry (None: no cap)


@dataclass(frozen=True)
class ShapeLimits:
    both: StepLimits = StepLimits()
    prefill: StepLimits = StepLimits()
    decode: StepLimits = StepLimits()


@dataclass(frozen=True)
class RateResult:
    """One shape at one rate. Goodput: requests that met both targets per second of offered load
    (within_slo / (requests / rate)), so it is the rate itself when every request met them."""

    rate: float
    requests: int
    within_slo: int
    goodput: float  # req/s
    throughput: float  # req/s: requests / (last finish - first arrival)
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    disaggregated: int = 0  # requests placement split between two `both` engines


class _Request:
    __slots__ = ("index", "arrival", "prompt", "left", "first", "finish", "decode_on")

    def __init__(self, index: int, arrival: float, prompt: int) -> None:
        self.index, self.arrival, self.prompt, self.left = index, arrival, prompt, prompt
        self.first = self.finish = math.nan
        self.decode_on: _Engine | None = None  # placed to decode on another engine than its prefill's


class _Engine:
    """One engine's queues and the run of steps it is in. A run is one step with prompt chunks, or
    `run_steps` decode-only steps of `step_s` each, ending where the first of its decodes finishes."""

    def __init__(self, index: int, role: str, rates: EngineProfile, limits: StepLimits) -> None:
        self.index, self.role = index, role
        self.a, self.b, self.c = rates.step_s, rates.step_per_stream_s, rates.prefill_s_per_token
        self.budget, self.max_seqs = limits.budget_tokens, limits.max_seqs
        self.prompts: deque[_Request] = deque()  # waiting or part-prefilled, first come first served
        self.queued_tokens = 0
        self.arriving: deque[_Request] = deque()  # KV arrived, not yet decoding (disaggregated)
        self.incoming = 0  # KV on its way here
        self.decoding: list[tuple[int, int, _Request]] = []  # heap: (step its last token ends, request index, request)
        self.steps = 0  # steps completed
        self.busy = False
        self.run_start = self.step_s = 0.0
        self.run_steps = 0
        self.chunks: list[tuple[_Request, int]] = []
        self.version = 0  # a run end scheduled before the run was cut short is stale
        self.given: GivenRate | None = None  # prompt tokens given to it recently (placement's prefill share)

    def streams(self) -> int:
        """Its decodes, running or on their way (the router charges a stream from its placement)."""
        return len(self.decoding) + len(self.arriving) + self.incoming

    def load(self) -> float:
        return self.queued_tokens * self.c + self.streams() * self.b

    def estimate(self, now: float) -> EngineEstimate:
        """This engine as the router's SLO model sees it now."""
        streams = self.streams()
        busy = self.given.per_s(now) * self.c if self.given is not None else 0.0
        # owed their second token: KV here or on its way, and its own prompts queued here
        fresh = len(self.arriving) + self.incoming + sum(r.decode_on is None for r in self.prompts)
        return EngineEstimate(str(self.index), "both", 1.0 / self.c, self.a + self.b * streams, self.budget,
                              self.b, queued_prefill_tokens=self.queued_tokens, decode_streams=streams,
                              fresh_streams=fresh, prefill_busy=busy)

    def give(self, req: _Request, now: float, window_s: float) -> None:
        self.prompts.append(req)
        self.queued_tokens += req.prompt
        if self.given is None:
            self.given = GivenRate(window_s, now)
        self.given.add(req.prompt, now)

    def start_run(self, now: float, decode_steps: int) -> float | None:
        """Start the next run at `now`; its end time (None: nothing to do, the engine idles)."""
        n = len(self.decoding)
        while self.arriving and (self.max_seqs is None or n < self.max_seqs):
            req = self.arriving.popleft()
            heapq.heappush(self.decoding, (self.steps + decode_steps, req.index, req))
            n += 1
        room = self.budget - n
        seats = math.inf if self.max_seqs is None else self.max_seqs - n
        chunks: list[tuple[_Request, int]] = []
        for req in self.prompts:
            if room <= 0 or seats <= 0:
                break
            take = min(req.left, room)
            chunks.append((req, take))
            room -= take
            seats -= 1
        if not n and not chunks:
            self.busy = False
            return None
        self.busy, self.chunks, self.run_start = True, chunks, now
        self.step_s = self.a + self.b * n + self.c * sum(take for _, take in chunks)
        self.run_steps = 1 if chunks else self.decoding[0][0] - self.steps
        self.version += 1
        return now + self.run_steps * self.step_s

    def cut_short(self, now: float) -> float | None:
        """New work at `now` during a decode-only run: end the run with the step under way. The new
        run end, when it moved (the caller schedules it)."""
        if not self.busy or self.chunks or self.run_steps == 1:
            return None
        under_way = min(self.run_steps, int((now - self.run_start) / self.step_s) + 1)
        if under_way == self.run_steps:
            return None
        self.run_steps = under_way
        self.version += 1
        return self.run_start + under_way * self.step_s

    def end_run(self, now: float) -> list[_Request]:
        """The run ends at `now`: its decodes that are done finish; the requests whose prompt it finished."""
        self.steps += self.run_steps
        prefilled = []
        for req, take in self.chunks:
            req.left -= take
            self.queued_tokens -= take
            if not req.left:
                req.first = now
                prefilled.append(req)
                self.prompts.remove(req)  # at the front: first come first served
        self.chunks = []
        while self.decoding and self.decoding[0][0] <= self.steps:
            heapq.heappop(self.decoding)[2].finish = now
        self.busy = False
        return prefilled


_ARRIVE, _RUN_END, _KV_READY = 0, 1, 2


def simulate(shape: Shape, profile: HardwareProfile, workload: Workload, rate: float, slo: SloTargets,
             limits: ShapeLimits = ShapeLimits(), placement: PlacementConfig | None = None,
             role_rates: Mapping[str, EngineProfile] | None = None,
             requests: Sequence[Request] | None = None) -> RateResult:
    """`workload`'s requests at `rate` on `shape`'s engines (rates: `profile.for_size`, or `role_rates`
    of the engine's role where given: what a live pool measured), deterministic; `placement`: the
    router's SLO model places each request on `both` engines (None: least loaded). `requests`: these
    arrivals instead of `workload.requests(rate)` (a benchmark predicting the very requests it sends).

    The engine model is vLLM's continuous batching with chunked prefill, costed by the product's one
    linear model (actors/rates.py): a step carries one token of each of the n running decodes, then up
    to budget - n prompt tokens of the waiting prompts, first come first served (a prompt may be split
    across steps), and lasts step_s + step_per_stream_s * n + prompt_tokens / prefill_tokens_per_s. A
    request's first token comes at the end of the step that finishes its prompt.

    Colocated (`both` engines): each request is placed as raypd's router places it under placement
    `slo` (`placement`: the deployment's `router.slo`): the product's `place()` is shown the engines
    of the router's shortlist (the SHORTLIST with the fewest streams and those with the fewest queued
    prompt tokens: all of them in a small pool), each as its estimate would show it (rates from the
    profile, its queued prompt tokens, its streams, the share of its recent time spent prefilling), and
    chooses colocated on one engine, or prefill on one and decode on another (the KV then moves in the
    profile's transfer time). Without `placement` (another
    policy), the engine with the least outstanding work (queued prompt tokens x c + decodes x b)
    prefills and decodes it. Disaggregated shapes: a request goes to the least loaded prefill engine
    (its steps carry no decodes); with its first token its KV moves to the least loaded decode engine,
    which then produces the other tokens.

    Speed: a run of decode-only steps (no prompt waiting, nothing new) advances to the next decode that
    finishes in one event, and is cut short at the step boundary when new work arrives, so the cost
    grows with requests and prefill steps, not with output tokens.
    """
    role_rates = role_rates or {}
    decode_steps = workload.output_tokens - 1  # tokens after the first, one per decode step
    engines: list[_Engine] = []
    for role, sizes, role_limits in (("both", shape.colocated, limits.both), ("prefill", shape.prefill, limits.prefill),
                                     ("decode", shape.decode, limits.decode)):
        engines += [_Engine(len(engines) + i, role, role_rates.get(role) or profile.for_size(k), role_limits)
                    for i, k in enumerate(sizes)]
    takers = [e for e in engines if e.role in ("both", "prefill")]  # where prompts go
    # where prefill engines hand their KV: the decode engines, else the role-flexible ones
    decoders = [e for e in engines if e.role == "decode"] or [e for e in engines if e.role == "both"]
    given = workload.requests(rate) if requests is None else sorted(requests, key=lambda r: r.arrival_s)
    if not given:
        raise ValueError("simulate: no requests to simulate")
    sent = [_Request(i, r.arrival_s, r.prompt_tokens) for i, r in enumerate(given)]
    window_s = (placement or PlacementConfig()).prefill_busy_window_s
    pull = TransferEstimate(profile.transfer_tokens_per_s, profile.transfer_overhead_s)
    placed = placement is not None and len(takers) > 1 and all(e.role == "both" for e in takers)

    order = itertools.count()  # ties in time: first scheduled first
    events: list[tuple[float, int, int, object, int]] = [(r.arrival, next(order), _ARRIVE, r, 0) for r in sent]
    heapq.heapify(events)

    def run(engine: _Engine, now: float) -> None:
        end = engine.start_run(now, decode_steps)
        if end is not None:
            heapq.heappush(events, (end, next(order), _RUN_END, engine, engine.version))

    def poke(engine: _Engine, now: float) -> None:
        if not engine.busy:
            run(engine, now)
        elif (end := engine.cut_short(now)) is not None:
            heapq.heappush(events, (end, next(order), _RUN_END, engine, engine.version))

    while events:
        now, _, kind, what, version = heapq.heappop(events)
        if kind == _ARRIVE:
            req = what
            if placed:
                shown = _shortlist(takers)
                chosen = place(req.prompt, [e.estimate(now) for e in shown], placement, lambda _p, _d: pull,
                               answer_tokens=workload.output_tokens).option
                engine = engines[int(chosen.prefill_id or chosen.decode_id)]
                if chosen.prefill_id is not None:
                    req.decode_on = engines[int(chosen.decode_id)]
                    req.decode_on.incoming += 1  # its stream counts there from now, as the router charges it
            else:
                engine = min(takers, key=lambda e: (e.load(), e.index))
            engine.give(req, now, window_s)
            poke(engine, now)
        elif kind == _KV_READY:
            req, engine = what
            engine.incoming -= 1
            engine.arriving.append(req)
            poke(engine, now)
        elif version == what.version:  # _RUN_END, not cut short since
            engine = what
            for req in engine.end_run(now):
                if not decode_steps:
                    req.finish = now
                elif req.decode_on is not None:  # placed apart: its KV moves to the engine chosen then
                    heapq.heappush(events, (now + profile.transfer_s(req.prompt), next(order), _KV_READY,
                                            (req, req.decode_on), 0))
                elif engine.role == "both":
                    heapq.heappush(engine.decoding, (engine.steps + decode_steps, req.index, req))
                else:  # prefill engine: the KV moves to a decode engine
                    target = min(decoders, key=lambda e: (e.load(), e.index))
                    target.incoming += 1
                    heapq.heappush(events, (now + profile.transfer_s(req.prompt), next(order), _KV_READY,
                                            (req, target), 0))
            run(engine, now)
    return _summary(sent, rate, slo, decode_steps)


def _shortlist(takers: list[_Engine]) -> list[_Engine]:
    """The engines the router's SloPlacer shows `place()` (`serving.routing.shortlist`): the SHORTLIST
    with the fewest streams and the SHORTLIST with the fewest queued prompt tokens, in index order."""
    keep = {*shortlist(takers, {}, _Engine.streams), *shortlist(takers, {}, lambda e: e.queued_tokens)}
    return [e for e in takers if e in keep]


def _summary(requests: list[_Request], rate: float, slo: SloTargets, decode_steps: int) -> RateResult:
    ttfts = [r.first - r.arrival for r in requests]
    tpots = [(r.finish - r.first) / decode_steps if decode_steps else 0.0 for r in requests]
    within = sum(slo.met(ttft, tpot) for ttft, tpot in zip(ttfts, tpots))
    span = max(r.finish for r in requests) - requests[0].arrival
    return RateResult(rate=rate, requests=len(requests), within_slo=within,
                      goodput=within / (len(requests) / rate),
                      throughput=len(requests) / span if span > 0 else math.inf,
                      ttft_p50_s=_percentile(ttfts, 50), ttft_p90_s=_percentile(ttfts, 90),
                      tpot_p50_s=_percentile(tpots, 50), tpot_p90_s=_percentile(tpots, 90),
                      disaggregated=sum(r.decode_on is not None for r in requests))


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)
