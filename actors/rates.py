"""The one rate model of an engine: the record an engine publishes (`EngineRates`) and the fit behind it.

One linear model per engine explains everything placement and the deadlines need:

  seconds = a * steps + b * (steps * batch) + c * prompt_tokens

(a: a step's fixed part, b: its growth per decoding stream, c: seconds per prompt token). The
engine fits it from what it serves and publishes it through the coordinator's route table, so every
ingress replica and the autoscaler read the same numbers; routers learn only what engines cannot
see (each pair's KV pull, their own hop). Pure: no Ray, no vLLM. The fit: `RidgeFit`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# floors of the coefficients: engine (a, b, c), pair (overhead, s/token)
ENGINE_FLOORS = (1e-5, 0.0, 1e-9)
PAIR_FLOORS = (0.0, 1e-10)

# what "moved materially" means for a published record (`EngineRates.moved_from`)
RATE_MOVE = 0.10  # a coefficient moved by more than this share
QUEUE_MOVE = 0.25  # the queue or the prompt tokens given per second moved by this share ...
QUEUE_MOVE_TOKENS = 64  # ... and by more than this many tokens
STREAMS_MOVE = 0.25  # the decode streams moved by this share (and by at least one stream)


@dataclass(frozen=True)
class EngineRates:
    """One engine's rates and load as it measured them itself: what it publishes, what routers read."""

    step_s: float  # a: a step's fixed part
    step_per_stream_s: float  # b: its growth per decoding stream
    prefill_s_per_token: float  # c
    samples: float = 0.0  # weight of the engine's own samples behind (a, b, c) (0: priors only)
    prefill_samples: float = 0.0  # of which carried prompt tokens (0: c is the prior)
    queued_prompt_tokens: int = 0  # prompt tokens queued or prefilling there now (every router's)
    decode_streams: int = 0  # streams decoding there now (every router's)
    prompt_tokens_per_s: float = 0.0  # prompt tokens given to it to prefill per second, recently
    chunk_budget_tokens: int | None = None  # its chunked-prefill budget (vLLM's), when it knows it

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.prefill_s_per_token

    @property
    def measured(self) -> bool:
        return self.samples > 0

    def decode_step_s(self, batch: int) -> float:
        return self.step_s + self.step_per_stream_s * max(0, batch)

    def moved_from(self, old: "EngineRates") -> bool:
        """Whether this record differs materially from `old` (the coordinator bumps its table then)."""
        if self.measured != old.measured or (self.prefill_samples > 0) != (old.prefill_samples > 0):
            return True
        if self.chunk_budget_tokens != old.chunk_budget_tokens:
            return True
        for new, was in ((self.step_s, old.step_s), (self.step_per_stream_s, old.step_per_stream_s),
                         (self.prefill_s_per_token, old.prefill_s_per_token)):
            if abs(new - was) > RATE_MOVE * max(abs(was), 1e-12):
                return True
        for new, was in ((self.queued_prompt_tokens, old.queued_prompt_tokens),
                         (self.prompt_tokens_per_s, old.prompt_tokens_per_s)):
            if abs(new - was) > max(QUEUE_MOVE_TOKENS, QUEUE_MOVE * abs(was)):
                return True
        return abs(self.decode_streams - old.decode_streams) > max(0.5, STREAMS_MOVE * old.decode_streams)


class RidgeFit:
    """Exponentially weighted least squares y ~ theta . x in relative terms, shrunk toward a prior center.

    Each sample is weighted by 1 / (reference . x)^2 (`reference`: the priors), so errors count
    relative to the sample's size: a 50 ms gap and a 5 s prefill teach alike. The ridge term pulls
    coefficient j toward its center as much as `prior_weight` average samples inform it (their mean
    x_j^2 weight), so the prior's share fades as 1 / samples whatever the units; before any sample
    a tiny ridge leaves the center itself.

    The fit: exponentially weighted least squares on relative
    errors (weights halve every `half_life_s`; a 50 ms gap and a 5 s prefill count
    alike), shrunk toward a prior worth `prior_weight` samples per coefficient
    (ridge), so a fit is defined from the first sample on and one outlier moves it
    by a bounded step. Idle time decays history only down to `min_history_weight`
    samples: what was learned survives a quiet hour. Coefficients stay above their
    floors (non-negative; per-token costs strictly positive). Pure: no Ray, no vLLM.
    """

    def __init__(self, reference: Sequence[float], floors: Sequence[float], half_life_s: float,
                 prior_weight: float, min_history_weight: float, now: float):
        n = len(reference)
        self.n, self.reference, self.floors = n, tuple(reference), tuple(floors)
        self.half_life_s, self.min_w = half_life_s, min_history_weight
        self.prior_weight = prior_weight
        self.min_ridge = [1e-6 / (r * r) for r in reference]
        self.xx = [[0.0] * n for _ in range(n)]
        self.xy = [0.0] * n
        self.weight, self.at = 0.0, now
        self.version = 0  # samples added so far: a solution is reused until the next one (`solve`)
        # a solution is reused while its history decayed by less than 0.1 % (87 ms at a 60 s half-life)
        self.reuse_s = half_life_s * -math.log2(1.0 - 1e-3)
        self._solved: tuple[int, tuple[float, ...], float, tuple[float, ...]] | None = None

    def _decay(self, now: float) -> None:
        dt, self.at = max(0.0, now - self.at), max(self.at, now)
        if not dt or not self.weight:
            return
        f = 0.5 ** (dt / self.half_life_s)
        f = max(f, min(1.0, self.min_w / self.weight))  # keep a floor of history through idle time
        self.weight *= f
        self.xy = [v * f for v in self.xy]
        self.xx = [[v * f for v in row] for row in self.xx]

    def add(self, x: Sequence[float], y: float, now: float, weight: float = 1.0) -> None:
        self._decay(now)
        w = weight / sum(r * v for r, v in zip(self.reference, x)) ** 2
        for i in range(self.n):
            self.xy[i] += w * x[i] * y
            for j in range(self.n):
                self.xx[i][j] += w * x[i] * x[j]
        self.weight += weight
        self.version += 1

    def solve(self, prior: Sequence[float], now: float) -> tuple[float, ...]:
        """argmin sum w (y - theta.x)^2 + sum ridge_j (theta_j - prior_j)^2 with theta_j >= floor_j.

        The same samples and prior within `reuse_s` give the last solution again: the answer moves
        only with a sample, a new prior or time."""
        prior = tuple(prior)
        last = self._solved
        if last is not None and last[0] == self.version and last[1] == prior and 0.0 <= now - last[2] <= self.reuse_s:
            return last[3]
        theta = tuple(self._solve_now(prior, now))
        self._solved = (self.version, prior, now, theta)
        return theta

    def _solve_now(self, prior: tuple[float, ...], now: float) -> list[float]:
        self._decay(now)
        ridge = [self.prior_weight * max(self.xx[j][j] / self.weight if self.weight else 0.0, self.min_ridge[j])
                 for j in range(self.n)]
        fixed: dict[int, float] = {}
        while True:
            free = [i for i in range(self.n) if i not in fixed]
            a = [[self.xx[i][j] + (ridge[i] if i == j else 0.0) for j in free] for i in free]
            rhs = [self.xy[i] + ridge[i] * prior[i] - sum(self.xx[i][j] * v for j, v in fixed.items())
                   for i in free]
            theta = dict(zip(free, _solve(a, rhs)))
            low = [i for i in free if theta[i] < self.floors[i]]
            if not low:
                return [fixed.get(i, theta.get(i, 0.0)) for i in range(self.n)]
            fixed.update({i: self.floors[i] for i in low})  # active set: pin, re-solve the rest


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (n <= 3; the ridge keeps `a` positive definite)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            m[r] = [vr - f * vc for vr, vc in zip(m[r], m[col])]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x
