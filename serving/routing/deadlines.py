"""Deadlines on every engine call a client waits for, and the engines that missed one (suspected hung).

Every wait is derived from the work it waits for, at the rates placement predicts with (the
engine's own, `serving.routing.rates`). Invariants: busy is not hung (a wait whose time is up goes
on while the same incarnation shows progress, up to `deadline_margin` x its deadline); an
incarnation that misses a deadline is suspected once: this router's other waits on it end, it gets
no new work until another incarnation is listed or `hung_engine_hold_s` passed, and the
coordinator, the one that decides, hears of it. Pure asyncio, one timer per wait. The formulas and
the rules: `EngineDeadlines`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

from serving.config import RouterConfig
from serving.routing.route_errors import EngineUnavailable
from serving.routing.rates import RateEstimator

logger = logging.getLogger("raypd.router")

T = TypeVar("T")


class EngineHung(EngineUnavailable):
    """The engine missed a deadline (or another wait on the same incarnation did): treated as hung."""

    def __init__(self, engine_id: str, call: str, seconds: float, first: bool = True):
        why = (f"missed its {call} deadline ({seconds:.1f} s)" if first
               else "missed a deadline of another request")
        super().__init__(f"engine {engine_id} {why}: treated as hung", died=False)
        self.engine_id, self.call, self.seconds = engine_id, call, seconds
        self.hung = True


Report = Callable[[str, "int | None", str], None]


class _Wait:
    """One wait in progress: its engine incarnation, its timeout and the check that may end it."""
    __slots__ = ("generation", "timer", "check", "last_call")

    def __init__(self, generation: int | None, timer: asyncio.Timeout, last_call: float):
        self.generation, self.timer, self.last_call = generation, timer, last_call
        self.check: asyncio.TimerHandle | None = None


class EngineDeadlines:
    """Every wait is derived from the work it waits for (RouterConfig fields), at the rates placement
    predicts with: the engine's own, as it published them to every router (`serving.routing.rates`;
    this router keeps no second estimate of them):

      a prefill call          floor + margin x prefill(engine, prompt tokens, queued)
      a stream's first chunk  floor + margin x prefill(engine, tokens)
                              (+ transfer.read_timeout_s when the decode engine pulls the KV first;
                              tokens: the prompt, plus what was streamed for a migrated stream)
      every later chunk       max(token_timeout_s, margin x step(engine))

      floor = deadline_floor_s, margin = deadline_margin;
      prefill(engine, tokens, queued): `RateEstimator.prefill_s`: the queue ahead (the larger of this
      router's own and the engine's published one) and the tokens at the engine's prefill rate, its
      chunked steps at its step time, plus this router's hop to it (its one local correction);
      step(engine): one decode step at the batch the engine published.

    A deadline is missed only when the engine shows no progress (busy is not hung): when a wait's
    time is up but this router heard from the same incarnation (any call on it returned) within the
    last `token_timeout_s`, the wait goes on until that engine has been silent for `token_timeout_s`,
    at most `deadline_margin` x its deadline in all. A frozen engine is still found one token timeout
    after its last output; a busy one (20 prompts queued on a prefill engine, a decode engine taking
    the streams of a failed one) is not failed, its clients are not migrated, nothing cascades.

    An engine incarnation that misses a deadline is suspected hung, once:

      - every other wait of this router on that incarnation ends now (`EngineHung`): its streams
        migrate at once instead of each waiting out its own deadline;
      - it gets no new work from this router until the directory lists another incarnation of it
        (the coordinator killed it and Ray restarted it) or `hung_engine_hold_s` passed (the
        coordinator probed it and found it alive);
      - the coordinator hears of it (`report`, fire and forget). The coordinator is the one that
        decides: it pings the engine with a timeout and, when that times out too, evicts the
        incarnation (its pairs' breakers open) and kills it so that Ray restarts it.

    Deadline misses are counted per (engine, call) (`raypd_deadline_misses_total`), waits that went
    on because the engine was busy per (engine, call) too (`extended`). Pure asyncio; `asyncio.timeout`
    (no task per wait), so a wait on the token path costs one timer.
    """

    def __init__(self, config: RouterConfig | None = None, pull_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, report: Report | None = None,
                 rates: RateEstimator | None = None):
        self.config = config or RouterConfig()
        self.pull_timeout_s = pull_timeout_s  # the decode engine's own bound on a KV pull
        self.clock = clock
        self.report = report  # (engine, generation, reason): the router tells the coordinator
        self.rates = rates or RateEstimator(self.config.slo, clock)  # the one model placement reads too
        self._waits: dict[str, set[_Wait]] = {}  # the waits in progress, per engine
        self._heard: dict[str, tuple[int | None, float]] = {}  # engine -> (incarnation, loop time): a call returned
        self.suspects: dict[str, tuple[int | None, float]] = {}  # engine -> (incarnation, since)
        self.misses: Counter[tuple[str, str]] = Counter()  # (engine, call) -> deadlines missed
        self.extended: Counter[tuple[str, str]] = Counter()  # (engine, call) -> waits let run on: busy

    # ------------------------------------------------------------ formulas
    def prefill_s(self, engine_id: str, tokens: int, queued: int = 0) -> float:
        c = self.config
        return c.deadline_floor_s + c.deadline_margin * self.rates.prefill_s(engine_id, tokens, queued)

    def first_chunk_s(self, engine_id: str, tokens: int, pulls: bool) -> float:
        """The first chunk of a stream: a local prefill of `tokens` (also what a failed pull
        recomputes), after the KV pull when there is one."""
        return self.prefill_s(engine_id, tokens) + (self.pull_timeout_s if pulls else 0.0)

    def token_s(self, engine_id: str) -> float:
        return max(self.config.token_timeout_s, self.config.deadline_margin * self.rates.step_s(engine_id))

    # ------------------------------------------------------------------ waits
    async def within(self, engine_id: str, generation: int | None, call: str, seconds: float,
                     work: Awaitable[T]) -> T:
        """`await work`, or `EngineHung` once `seconds` passed with no progress of the engine (or
        another wait on this engine incarnation missed its deadline)."""
        waits = self._waits.setdefault(engine_id, set())
        loop = asyncio.get_running_loop()
        start = loop.time()
        wait = None
        try:
            async with asyncio.timeout(None) as timer:  # armed by the check below, never on its own
                wait = _Wait(generation, timer, start + self.config.deadline_margin * seconds)
                wait.check = loop.call_at(start + seconds, self._check, engine_id, call, wait)
                waits.add(wait)
                try:
                    result = await work
                finally:
                    waits.discard(wait)
                    wait.check.cancel()
            self._heard[engine_id] = (generation, loop.time())
            return result
        except TimeoutError:
            if wait is None or not wait.timer.expired():
                raise  # the work's own timeout, not ours
            raise self._missed(engine_id, generation, call, seconds) from None

    def _check(self, engine_id: str, call: str, wait: _Wait) -> None:
        """A wait's time is up: it goes on while the engine is busy (heard from within
        `token_timeout_s`) and under its last call; otherwise it ends now (a missed deadline)."""
        if wait.timer.expired():
            return  # ended already (another wait on the incarnation missed its deadline)
        loop = asyncio.get_running_loop()
        now = loop.time()
        heard = self._heard.get(engine_id)
        if heard is not None and heard[0] == wait.generation:
            silent_at = heard[1] + self.config.token_timeout_s
            if now < silent_at and now < wait.last_call:
                self.extended[(engine_id, call)] += 1
                wait.check = loop.call_at(min(silent_at, wait.last_call), self._check, engine_id, call, wait)
                return
        wait.timer.reschedule(now)  # expires at once: the awaiting task gets a TimeoutError

    def _missed(self, engine_id: str, generation: int | None, call: str, seconds: float) -> EngineHung:
        if self.suspected(engine_id, generation):  # another wait found it first: already handled
            return EngineHung(engine_id, call, seconds, first=False)
        self.misses[(engine_id, call)] += 1
        self.suspects[engine_id] = (generation, self.clock())
        reason = f"missed its {call} deadline ({seconds:.1f} s)"
        logger.warning("engine %s (incarnation %s) %s: treated as hung", engine_id, generation, reason)
        now = asyncio.get_running_loop().time()
        for wait in list(self._waits.get(engine_id, ())):
            if wait.generation == generation and not wait.timer.expired():
                wait.check.cancel()
                wait.timer.reschedule(now)  # its other waits end now: their streams move at once
        if self.report is not None:
            try:
                self.report(engine_id, generation, reason)
            except Exception as exc:  # noqa: BLE001 - the coordinator being away must not fail routing
                logger.info("reporting the hang of %s failed: %s", engine_id, exc)
        return EngineHung(engine_id, call, seconds)

    # -------------------------------------------------------------- suspects
    def suspected(self, engine_id: str, generation: int | None) -> bool:
        """True while this incarnation of the engine is held back as hung."""
        held = self.suspects.get(engine_id)
        if held is None:
            return False
        gen, since = held
        if gen != generation or self.clock() - since > self.config.hung_engine_hold_s:
            del self.suspects[engine_id]  # restarted (a new incarnation), or found alive meanwhile
            return False
        return True

    def suspected_in(self, generations: dict[str, int]) -> list[str]:
        """The engines of `generations` (the directory's view) held back as hung now."""
        return [e for e in list(self.suspects) if self.suspected(e, generations.get(e))]
