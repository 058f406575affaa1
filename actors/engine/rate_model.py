"""An engine's own rate fit: the one model of its prefill rate and step time (`actors.rates`).

The engine sees every request of every router, at its true decode batch and queue, so it is the one
that measures (its `LoadMeter` feeds this): inter-token gaps while nothing prefills, and prefills'
wall times with the tokens queued ahead. Priors and half-life: `EngineConfig.rates`. `rates()` is
the record it publishes (`actors.engine.rates_publisher`). Pure: no Ray, no vLLM; injectable clock.
What each observation contributes: `EngineRateModel`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from actors.engine.config import RateModelConfig
from actors.rates import ENGINE_FLOORS, EngineRates, RidgeFit

DEFAULT_BUDGET = 2048  # vLLM's max_num_batched_tokens for an engine raypd starts, when the engine's is unknown


class EngineRateModel:
    """What each observation contributes to the fit:

      observe_gap      an inter-token gap of its streams while no prompt was prefilling there:
                       one step at that batch, x = (1, batch, 0)
      observe_prefill  a prefill's wall time in the engine (a `prefill()` call, or the first chunk
                       of a local one), the prompt tokens queued ahead of it included: those tokens
                       and the prompt's computed ones (cached ones excluded), chunked by its budget:
                       x = (steps, steps * batch, tokens), steps = ceil(tokens / budget); only when
                       those tokens cost `min_prefill_steps` steps' fixed part or more (a short
                       prompt's time is its first token's fixed path: it would land in c)
      observe_step     the general form of both

    Priors and half-life: `EngineConfig.rates` (the deployment's `router.slo` priors, or what the
    role's live engines measured when the autoscaler starts this engine). `rates()` is the record
    it publishes (`actors.engine.rates_publisher`). Pure: no Ray, no vLLM; injectable clock.
    """

    def __init__(self, config: RateModelConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config, self.clock = config or RateModelConfig(), clock
        c, now = self.config, clock()
        self.prior = (c.prior_step_s, c.prior_step_per_stream_s, 1.0 / c.prior_prefill_tokens_per_s)
        self._fit = RidgeFit(self.prior, ENGINE_FLOORS, c.rate_half_life_s, c.prior_weight, c.min_history_weight, now)
        self._prefill_share = 0.0  # of the fit's sample weight, what carried prompt tokens (decay keeps it)

    def observe_step(self, seconds: float, decode_batch: int, prompt_tokens: int = 0, steps: int = 1,
                     weight: float = 1.0) -> None:
        """`steps` engine steps alike (batch, prompt tokens in all of them) took `seconds`.

        `weight`: a step seen through every one of its N streams' gaps counts 1/N per gap."""
        if not (seconds > 0 and math.isfinite(seconds) and steps >= 1 and weight > 0):
            return  # a clock glitch or an empty sample: nothing to learn
        x = (float(steps), float(steps * max(0, decode_batch)), float(max(0, prompt_tokens)))
        self._fit.add(x, seconds, self.clock(), weight)
        before = self._fit.weight - weight  # the history, decayed to now, before this sample
        self._prefill_share = (self._prefill_share * before + (weight if prompt_tokens > 0 else 0.0)) / self._fit.weight

    def observe_gap(self, seconds: float, decode_batch: int, weight: float = 1.0) -> None:
        """An inter-token gap of a step that carried no prompt chunk."""
        self.observe_step(seconds, decode_batch, 0, 1, weight)

    def observe_prefill(self, tokens: int, seconds: float, decode_batch: int = 0,
                        budget_tokens: int | None = None) -> None:
        """`tokens` prompt tokens (this prompt's computed ones and those queued ahead of it) done in
        `seconds` beside `decode_batch` streams."""
        if tokens < 1 or tokens < self.min_prefill_tokens():
            return
        steps = math.ceil(tokens / (budget_tokens or DEFAULT_BUDGET))
        self.observe_step(seconds, decode_batch, tokens, steps)

    def min_prefill_tokens(self) -> float:
        """The fewest tokens a prefill needs to teach the fit: their compute, at the rates now, is
        `min_prefill_steps` steps' fixed part (160 tokens at the default priors). At most
        `DEFAULT_BUDGET`: a fit that believes prefills nearly free still hears of long ones."""
        a, _, c = self._fit.solve(self.prior, self.clock())
        return min(self.config.min_prefill_steps * a / c, DEFAULT_BUDGET)

    def rates(self, queued_prompt_tokens: int = 0, decode_streams: int = 0, prompt_tokens_per_s: float = 0.0,
              chunk_budget_tokens: int | None = None) -> EngineRates:
        """The fit now, with the load the caller (the meter) knows: the record the engine publishes."""
        now = self.clock()
        a, b, c = self._fit.solve(self.prior, now)
        return EngineRates(a, b, c, samples=round(self._fit.weight, 3),
                           prefill_samples=round(self._fit.weight * self._prefill_share, 3),
                           queued_prompt_tokens=int(queued_prompt_tokens), decode_streams=int(decode_streams),
                           prompt_tokens_per_s=round(prompt_tokens_per_s, 1), chunk_budget_tokens=chunk_budget_tokens)
