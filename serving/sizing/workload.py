"""What the shapes are judged on: the requests (`Workload`) and the latency targets (`SloTargets`).

  Workload.requests(rate)  the requests of one rate: Poisson arrivals, prompt lengths drawn from the
                           mix, the same seed at every rate (so shapes and rates see alike draws)
  SloTargets.met(ttft, tpot)  whether one request met both targets
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_tokens: int


@dataclass(frozen=True)
class Workload:
    """`requests_per_rate` requests at each of `rates` (req/s, Poisson arrivals); prompt lengths drawn
    from `prompt_mix` ((tokens, share), shares need not sum to 1); every request asks for
    `output_tokens` tokens (the first comes with the prefill)."""

    prompt_mix: tuple[tuple[int, float], ...]
    output_tokens: int
    rates: tuple[float, ...]
    requests_per_rate: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_mix or any(t < 1 or s <= 0 for t, s in self.prompt_mix):
            raise ValueError(f"prompt_mix: (tokens >= 1, share > 0) pairs, at least one (got {self.prompt_mix})")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1 (got {self.output_tokens})")
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates: at least one, each > 0 req/s (got {self.rates})")
        if self.requests_per_rate < 1:
            raise ValueError(f"requests_per_rate must be >= 1 (got {self.requests_per_rate})")

    @property
    def longest_prompt(self) -> int:
        return max(t for t, _ in self.prompt_mix)

    def requests(self, rate: float) -> tuple[Request, ...]:
        rng = random.Random(self.seed)
        tokens = [t for t, _ in self.prompt_mix]
        shares = [s for _, s in self.prompt_mix]
        at, out = 0.0, []
        for _ in range(self.requests_per_rate):
            out.append(Request(at, rng.choices(tokens, shares)[0]))
            at += rng.expovariate(rate)
        return tuple(out)


@dataclass(frozen=True)
class SloTargets:
    """Per request: time to first token, and mean time per output token after it (vLLM's serving
    benchmark's TPOT: (e2e - ttft) / (output_tokens - 1))."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLO targets must be > 0 (got ttft_s {self.ttft_s}, tpot_s {self.tpot_s})")

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        return ttft_s <= self.ttft_s and tpot_s <= self.tpot_s
