"""An engine's own load, as the autoscaler reads it from `EngineActor.load()`.

Life cycle of what it tracks:

  prefill   `prefill_started(req)` adds the prompt's tokens to the queue,
            `prefill_done` removes them and records the prefill latency (the
            prefill pool's share of time to first token);
  decode    `decode_started(req)` owes the request's max_tokens, every streamed
            chunk pays some back and records the gap since the previous one
            (inter-token latency), `done()` settles the rest.

Queues are reported now and as a time-weighted average (exponential, time
constant `window_s`), so a control loop sampling every few seconds sees load
that comes and goes between its samples; latencies as the p90 of the samples
of the last `window_s`. Pure Python with an injectable clock.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors.protocol import BackendStats, LoadSnapshot

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

    def add(self, now: float) -> None:
        self.per_s(now)
        self.count += 1.0

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


class DecodeTrack:
    """One decode request's debt to its engine."""

    def __init__(self, meter: "LoadMeter", owed: int):
        self.meter, self.owed, self.asked = meter, owed, owed
        self.first = True  # the first chunk's wait is prefill or a KV pull, not an inter-token gap
        self.last = meter.clock()
        meter._outstanding.add(owed, self.last)

    def observe(self, chunk: Any) -> None:
        n = len(chunk.token_ids)
        if not n:
            return
        now = self.meter.clock()
        if not self.first:
            self.meter._itl.add((now - self.last) / n, now)
            self.meter._step.add((now - self.last) / n)
        self.first, self.last = False, now
        paid = min(n, self.owed)
        self.owed -= paid
        self.meter._outstanding.add(-paid, now)

    def done(self) -> None:
        self.meter._output.add(self.asked - self.owed)
        if self.owed:
            self.meter._outstanding.add(-self.owed, self.meter.clock())
            self.owed = 0


class LoadMeter:
    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        now = clock()
        self._queued = _Average(window_s, now)
        self._outstanding = _Average(window_s, now)
        self._prefill_latency = _Latencies(window_s)
        self._itl = _Latencies(window_s)
        self._prefill_rate, self._step = _Ewma(), _Ewma()  # tokens/s of prefills, s per decoded token
        self._prompt, self._output = _Ewma(), _Ewma()  # per decoded request
        self._arrivals = _Rate(window_s * 6, now)  # decode starts per second

    def prefill_started(self, req: Any) -> tuple[int, float]:
        n = _estimate_prompt_tokens(req)
        now = self.clock()
        self._queued.add(n, now)
        return n, now

    def prefill_done(self, started: tuple[int, float]) -> None:
        n, t0 = started
        now = self.clock()
        self._queued.add(-n, now)
        self._prefill_latency.add(now - t0, now)
        if now > t0:
            self._prefill_rate.add(n / (now - t0))

    def decode_started(self, req: Any) -> DecodeTrack:
        self._arrivals.add(self.clock())
        self._prompt.add(_estimate_prompt_tokens(req) - getattr(req, "num_resumed_tokens", 0))
        return DecodeTrack(self, req.max_tokens)

    def snapshot(self) -> LoadSnapshot:
        now = self.clock()
        return LoadSnapshot(
            queued_prompt_tokens=self._queued.value, queued_prompt_tokens_avg=round(self._queued.read(now), 1),
            outstanding_tokens=self._outstanding.value,
            outstanding_tokens_avg=round(self._outstanding.read(now), 1),
            prefill_latency_p90_s=self._prefill_latency.p90(now), itl_p90_s=self._itl.p90(now),
            prefill_tokens_per_s=self._prefill_rate.value, step_s=self._step.value,
            arrivals_per_s=round(self._arrivals.per_s(now), 4),
            prompt_tokens_avg=self._prompt.value, output_tokens_avg=self._output.value,
        )
