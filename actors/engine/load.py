"""An engine's own load, as the autoscaler reads it from `EngineActor.load()`.

It tracks the prefill queue and the tokens decode streams still owe, reported now and as a
time-weighted average (so a control loop sampling every few seconds sees load that comes and goes
between samples), with latencies as the p90 of the last `window_s`. It is also where the engine's
one rate model learns (`actors.engine.rate_model`); `rates()` is what the engine publishes to every
router and the autoscaler reads. Pure Python with an injectable clock. What it tracks, and when:
`LoadMeter`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors.engine.config import RateModelConfig
from actors.engine.rate_model import EngineRateModel
from actors.protocol.stats import BackendStats, LoadSnapshot
from actors.rates import EngineRates

MAX_SAMPLES = 2048


def _estimate_prompt_tokens(req: Any) -> int:
    if req.prompt_token_ids:
        return len(req.prompt_token_ids)
    text = req.prompt or "".join(str(m.get("content") or "") for m in (req.messages or ()))
    return max(1, len(text) // 4)


class _Average:
    """A time-weighted exponential average of a piecewise-constant value."""

    def __init__(self, tau_s: float, now: float):
        self.tau_s, self.value, self.avg, self.at = tau_s, 0, 0.0, now

    def _advance(self, now: float) -> None:
        dt = max(0.0, now - self.at)
        self.avg += (1.0 - math.exp(-dt / self.tau_s)) * (self.value - self.avg)
        self.at = now

    def add(self, delta: int, now: float) -> None:
        self._advance(now)
        self.value = max(0, self.value + delta)

    def read(self, now: float) -> float:
        self._advance(now)
        return self.avg


class _Rate:
    """Events per second, recently: a count decayed with time constant `tau_s`."""

    def __init__(self, tau_s: float, now: float):
        self.tau_s, self.count, self.at = tau_s, 0.0, now

    def add(self, now: float, amount: float = 1.0) -> None:
        self.per_s(now)
        self.count += amount

    def per_s(self, now: float) -> float:
        if now > self.at:
            self.count *= math.exp(-(now - self.at) / self.tau_s)
            self.at = now
        return self.count / self.tau_s


class _Latencies:
    def __init__(self, window_s: float):
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def add(self, seconds: float, now: float) -> None:
        self.samples.append((now, seconds))

    def p90(self, now: float) -> float | None:
        while self.samples and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()
        if not self.samples:
            return None
        values = sorted(v for _, v in self.samples)
        return values[min(len(values) - 1, int(0.9 * len(values)))]


@dataclass(frozen=True)
class EngineLoad:
    """What the autoscaler reads from one engine (`EngineActor.load()`)."""

    engine_id: str
    role: str
    running: int  # decode streams in the engine
    held_leases: int  # prefill requests whose blocks wait for their reader (when the backend knows)
    kv_usage: float  # fraction of KV blocks in use
    meter: LoadSnapshot

    @property
    def idle(self) -> bool:
        return not (self.running or self.held_leases or self.meter.queued_prompt_tokens)

    @classmethod
    def of(cls, engine_id: str, role: str, running: int, backend: BackendStats, meter: LoadSnapshot) -> "EngineLoad":
        total, free = backend.num_blocks, backend.free_blocks
        return cls(engine_id, role, running, backend.held_leases, round(1.0 - free / total, 4) if total else 0.0,
                   meter)


class _Ewma:
    """A moving average of samples (weight `alpha` for the newest); None before the first."""

    def __init__(self, alpha: float = 0.1):
        self.alpha, self.value = alpha, None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


@dataclass(frozen=True)
class PrefillStart:
    """A prompt the engine started to prefill: its tokens, when, and what it found there."""

    tokens: int
    at: float
    ahead: int  # prompt tokens queued or prefilling there before it
    streams: int  # streams decoding there meanwhile


class DecodeTrack:
    """One decode request's debt to its engine (and, prefilled here, its prompt in the queue)."""

    def __init__(self, meter: "LoadMeter", owed: int, prefill: PrefillStart | None = None):
        self.meter, self.owed, self.asked = meter, owed, owed
        self.first = True  # the first chunk's wait is prefill or a KV pull, not an inter-token gap
        self.prefill = prefill  # a local prefill (no KV to pull): queued until the first chunk
        self.last = meter.clock()
        self.open = True
        meter._outstanding.add(owed, self.last)
        meter._decoding.add(1, self.last)

    def observe(self, chunk: Any) -> None:
        n = len(chunk.token_ids)
        if not n:
            return
        now = self.meter.clock()
        if self.first and self.prefill is not None:
            self.meter.prefill_done(self.prefill, getattr(chunk, "num_cached_tokens", None))
            self.prefill = None
        elif not self.first:
            self.meter._gap((now - self.last) / n, now)
        self.first, self.last = False, now
        paid = min(n, self.owed)
        self.owed -= paid
        self.meter._outstanding.add(-paid, now)

    def done(self) -> None:
        if not self.open:
            return
        self.open = False
        if self.prefill is not None:  # ended before its first token: its prompt leaves the queue, unlearned
            self.meter.prefill_done(self.prefill, ok=False)
            self.prefill = None
        self.meter._output.add(self.asked - self.owed)
        now = self.meter.clock()
        if self.owed:
            self.meter._outstanding.add(-self.owed, now)
            self.owed = 0
        self.meter._decoding.add(-1, now)


class LoadMeter:
    """Life cycle of what it tracks:

      prefill   `prefill_started(req)` adds the prompt's tokens to the queue,
                `prefill_done` removes them and records the prefill latency (the
                prefill pool's share of time to first token);
      decode    `decode_started(req)` owes the request's max_tokens, every streamed
                chunk pays some back and records the gap since the previous one
                (inter-token latency), `done()` settles the rest.

    Queues are reported now and as a time-weighted average (exponential, time
    constant `window_s`), so a control loop sampling every few seconds sees load
    that comes and goes between its samples; latencies as the p90 of the samples
    of the last `window_s`.

    It is also where the engine's one rate model learns (`actors.engine.rate_model`):
    a prefill's wall time, with the prompt tokens queued ahead of it and the decode
    streams beside it, and every inter-token gap while nothing prefills there (one
    step at the engine's batch). `rates()` is what the engine publishes to every
    router (`actors.engine.rates_publisher`) and what the autoscaler reads in
    `snapshot().rates`. Pure Python with an injectable clock.
    """

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 rates: RateModelConfig | None = None):
        self.clock = clock
        now = clock()
        self.model = EngineRateModel(rates, clock)  # the engine's one rate model
        self.budget_tokens: int | None = None  # its chunked-prefill budget, once the backend says it
        self._queued = _Average(window_s, now)
        self._outstanding = _Average(window_s, now)
        self._decoding = _Average(window_s, now)  # streams decoding here
        self._prefill_latency = _Latencies(window_s)
        self._itl = _Latencies(window_s)
        self._prompt, self._output = _Ewma(), _Ewma()  # per decoded request
        self._arrivals = _Rate(window_s * 6, now)  # decode starts per second
        self._given = _Rate(self.model.config.prefill_busy_window_s, now)  # prompt tokens given to prefill per second

    def prefill_started(self, req: Any) -> PrefillStart:
        n = _estimate_prompt_tokens(req)
        now = self.clock()
        started = PrefillStart(n, now, self._queued.value, self._decoding.value)
        self._queued.add(n, now)
        self._given.add(now, n)
        return started

    def prefill_done(self, started: PrefillStart, cached_tokens: int | None = None, ok: bool = True) -> None:
        """The prompt left the queue; once it produced its first token (`ok`), its wall time teaches
        the rate model: the tokens queued ahead of it and its own computed ones (`cached_tokens`: what
        the prefix cache held) beside the streams decoding here."""
        now = self.clock()
        self._queued.add(-started.tokens, now)
        self._prefill_latency.add(now - started.at, now)
        if ok and now > started.at:
            computed = max(1, started.tokens - (cached_tokens or 0))
            self.model.observe_prefill(started.ahead + computed, now - started.at, started.streams,
                                       self.budget_tokens)

    def decode_started(self, req: Any, local_prefill: bool = False) -> DecodeTrack:
        """A stream starts; `local_prefill`: the engine prefills its prompt itself (no KV to pull)."""
        self._arrivals.add(self.clock())
        self._prompt.add(_estimate_prompt_tokens(req) - getattr(req, "num_resumed_tokens", 0))
        return DecodeTrack(self, req.max_tokens, self.prefill_started(req) if local_prefill else None)

    def _gap(self, per_token_s: float, now: float) -> None:
        """A stream's gap per token: its ITL; one step at the batch when no prompt prefilled meanwhile
        (a prompt's chunks ride in those steps: they teach the prefill rate instead)."""
        self._itl.add(per_token_s, now)
        batch = self._decoding.value
        if not self._queued.value:
            self.model.observe_gap(per_token_s, batch, weight=1.0 / max(1, batch))

    def rates(self) -> EngineRates:
        """The engine's rates and load now: the record it publishes."""
        now = self.clock()
        return self.model.rates(self._queued.value, self._decoding.value, self._given.per_s(now),
                                self.budget_tokens)

    def snapshot(self) -> LoadSnapshot:
        now = self.clock()
        rates = self.rates()
        streams = round(self._decoding.read(now))
        return LoadSnapshot(
            queued_prompt_tokens=self._queued.value, queued_prompt_tokens_avg=round(self._queued.read(now), 1),
            outstanding_tokens=self._outstanding.value,
            outstanding_tokens_avg=round(self._outstanding.read(now), 1),
            prefill_latency_p90_s=self._prefill_latency.p90(now), itl_p90_s=self._itl.p90(now),
            prefill_tokens_per_s=rates.prefill_tokens_per_s if rates.prefill_samples > 0 else None,
            step_s=rates.decode_step_s(streams) if rates.measured else None,
            arrivals_per_s=round(self._arrivals.per_s(now), 4),
            prompt_tokens_avg=self._prompt.value, output_tokens_avg=self._output.value, rates=rates,
        )
