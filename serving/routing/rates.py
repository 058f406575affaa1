"""Online estimates of engine rates and KV pull rates for placement (pure, injectable clock).

One linear model per engine explains everything placement needs:

  seconds = a * steps + b * (steps * batch) + c * prompt_tokens

a: an engine step's fixed part, b: its growth per decoding stream, c: seconds
per prompt token prefilled (prefill rate 1 / c). Every signal is a linear
observation of (a, b, c):

  observe_gap      an inter-token gap of a step without a prompt chunk: (1, batch, 0)
  observe_step     one step (or several alike) with its prompt tokens: (steps, steps * batch, tokens)
  observe_prefill  a prefill's compute time (vLLM's `prefill_time`: scheduled -> first token,
                   queue excluded), chunked by the engine's budget: (ceil(T / B), ceil(T / B) * batch, T)

KV pulls per pair: seconds = overhead + tokens / rate (`observe_transfer`).

Fits are exponentially weighted least squares on relative errors (weights
halve every `rate_half_life_s` / `transfer_half_life_s`; a 50 ms gap and a 5 s
prefill count alike), shrunk toward a prior worth `prior_weight` samples per
coefficient (ridge), so a fit is defined from the first sample on and one
outlier moves it by a bounded step. Priors are hierarchical:
the config's priors feed a pooled fit over all engines (pairs), and the pooled
fit is the prior of each engine (pair), so a new engine starts from what the
others measured, not from hand-set numbers. Idle time decays history only down
to `min_history_weight` samples: what was learned survives a quiet hour.
Coefficients stay non-negative (per-token costs strictly positive).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from serving.placement_config import PlacementConfig
from serving.routing.placement import EngineEstimate, Role, TransferEstimate

# floors of the coefficients: engine (a, b, c), pair (overhead, s/token)
_ENGINE_FLOORS = (1e-5, 0.0, 1e-9)
_PAIR_FLOORS = (0.0, 1e-10)


class _RidgeFit:
    """Exponentially weighted least squares y ~ theta . x in relative terms, shrunk toward a prior center.

    Each sample is weighted by 1 / (reference . x)^2 (`reference`: the config's
    priors), so errors count relative to the sample's size: a 50 ms gap and a 5 s
    prefill teach alike. The ridge term pulls coefficient j toward its center as
    much as `prior_weight` average samples inform it (their mean x_j^2 weight), so
    the prior's share fades as 1 / samples whatever the units; before any sample
    a tiny ridge leaves the center itself.
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

        The same samples and prior within `reuse_s` give the last solution again: a placement asks
        for one engine's rates many times (every option it is in), and the answer moves only with a
        sample, a new prior or time."""
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


@dataclass(frozen=True)
class EngineRates:
    step_s: float  # a step's fixed part
    step_per_stream_s: float
    prefill_s_per_token: float
    samples: float  # weight of the engine's own samples behind it (0: pooled / priors only)

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.prefill_s_per_token

    def decode_step_s(self, batch: int) -> float:
        return self.step_s + self.step_per_stream_s * max(0, batch)


class RateEstimator:
    def __init__(self, config: PlacementConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config, self.clock = config or PlacementConfig(), clock
        c = self.config
        self._engine_prior = (c.prior_step_s, c.prior_step_per_stream_s, 1.0 / c.prior_prefill_tokens_per_s)
        self._pair_prior = (c.prior_transfer_overhead_s, 1.0 / c.prior_transfer_tokens_per_s)
        self._pooled_engine = self._engine_fit()
        self._pooled_pair = self._pair_fit()
        self._engines: dict[str, _RidgeFit] = {}
        self._pairs: dict[tuple[str, str], _RidgeFit] = {}
        self._pooled_transfer: tuple[tuple[float, ...] | None, TransferEstimate | None] = (None, None)

    def _engine_fit(self) -> _RidgeFit:
        c = self.config
        return _RidgeFit(self._engine_prior, _ENGINE_FLOORS, c.rate_half_life_s, c.prior_weight,
                         c.min_history_weight, self.clock())

    def _pair_fit(self) -> _RidgeFit:
        c = self.config
        return _RidgeFit(self._pair_prior, _PAIR_FLOORS, c.transfer_half_life_s, c.prior_weight,
                         c.min_history_weight, self.clock())

    # ----------------------------------------------------------- samples
    def observe_step(self, engine_id: str, seconds: float, decode_batch: int, prompt_tokens: int = 0,
                     steps: int = 1, weight: float = 1.0) -> None:
        """`steps` engine steps alike (batch, prompt tokens in all of them) took `seconds`.

        `weight`: a step seen through every one of its N streams' gaps counts 1/N per gap."""
        if not (seconds > 0 and math.isfinite(seconds) and steps >= 1 and weight > 0):
            return  # a clock glitch or an empty sample: nothing to learn
        x = (float(steps), float(steps * max(0, decode_batch)), float(max(0, prompt_tokens)))
        now = self.clock()
        self._pooled_engine.add(x, seconds, now, weight)
        self._engines.setdefault(engine_id, self._engine_fit()).add(x, seconds, now, weight)

    def observe_gap(self, engine_id: str, seconds: float, decode_batch: int, weight: float = 1.0) -> None:
        """An inter-token gap of a step that carried no prompt chunk (skip gaps while a local prefill runs)."""
        self.observe_step(engine_id, seconds, decode_batch, 0, 1, weight)

    def observe_prefill(self, engine_id: str, tokens: int, seconds: float, decode_batch: int = 0,
                        budget_tokens: int | None = None) -> None:
        """`tokens` prompt tokens computed in `seconds` (queue wait excluded) beside `decode_batch` streams."""
        if tokens < 1:
            return
        steps = math.ceil(tokens / (budget_tokens or self.config.default_chunk_budget_tokens))
        self.observe_step(engine_id, seconds, decode_batch, tokens, steps)

    def observe_transfer(self, prefill_id: str, decode_id: str, tokens: int, seconds: float) -> None:
        """A KV pull of `tokens` tokens from prefill_id to decode_id took `seconds` (params in -> KV loaded)."""
        if not (seconds > 0 and math.isfinite(seconds)) or tokens < 0:
            return
        now = self.clock()
        self._pooled_pair.add((1.0, float(tokens)), seconds, now)
        self._pairs.setdefault((prefill_id, decode_id), self._pair_fit()).add((1.0, float(tokens)), seconds, now)

    def forget(self, engine_id: str) -> None:
        """The engine left the pool: drop its fits and its pairs' (the pooled fits keep what it taught)."""
        self._engines.pop(engine_id, None)
        for pair in [p for p in self._pairs if engine_id in p]:
            del self._pairs[pair]

    # ----------------------------------------------------------- estimates
    def rates(self, engine_id: str) -> EngineRates:
        now = self.clock()
        pooled = self._pooled_engine.solve(self._engine_prior, now)
        fit = self._engines.get(engine_id)
        if fit is None:
            return EngineRates(*pooled, samples=0.0)
        return EngineRates(*fit.solve(pooled, now), samples=round(fit.weight, 3))

    def transfer(self, prefill_id: str, decode_id: str) -> TransferEstimate:
        """The pair's pull estimate (a `placement.TransferOf`)."""
        now = self.clock()
        pooled = self._pooled_pair.solve(self._pair_prior, now)
        fit = self._pairs.get((prefill_id, decode_id))
        if fit is not None:
            overhead, per_token = fit.solve(pooled, now)
            return TransferEstimate(tokens_per_s=1.0 / per_token, overhead_s=overhead)
        if self._pooled_transfer[0] is not pooled:  # pairs never measured share the pooled estimate
            self._pooled_transfer = (pooled, TransferEstimate(tokens_per_s=1.0 / pooled[1], overhead_s=pooled[0]))
        return self._pooled_transfer[1]

    def estimate(self, engine_id: str, role: Role, *, decode_streams: int = 0, queued_prefill_tokens: int = 0,
                 cached_tokens: int = 0, chunk_budget_tokens: int | None = None,
                 prefill_busy: float = 0.0) -> EngineEstimate:
        """What `placement.place` needs about one engine: its rates now, with the load the caller knows."""
        r = self.rates(engine_id)
        return EngineEstimate(engine_id, role, r.prefill_tokens_per_s, r.decode_step_s(decode_streams),
                              chunk_budget_tokens or self.config.default_chunk_budget_tokens,
                              r.step_per_stream_s, cached_tokens, queued_prefill_tokens, decode_streams,
                              prefill_busy)

    def snapshot(self) -> dict:
        """Learned rates per engine and pair, for status and metrics."""
        engines = {e: self.rates(e) for e in self._engines}
        pairs = {p: self.transfer(*p) for p in self._pairs}
        return {
            "engines": {e: {"prefill_tokens_per_s": round(r.prefill_tokens_per_s, 1), "step_s": round(r.step_s, 5),
                            "step_per_stream_s": round(r.step_per_stream_s, 6), "samples": r.samples}
                        for e, r in engines.items()},
            "transfers": {f"{p}->{d}": {"tokens_per_s": round(t.tokens_per_s, 1), "overhead_s": round(t.overhead_s, 4)}
                          for (p, d), t in pairs.items()},
        }
