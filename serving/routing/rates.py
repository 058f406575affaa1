"""The rates a router predicts with: every engine's own (one model, shared), its hop, each pair's pull.

Invariants: a router does not fit engine rates itself (each engine fits `actors.rates`' model from
what it serves and publishes it through the route table, so every router holding one table version
reads the same numbers); load is the larger of this router's own share and the engine's published
one (never counted twice); this router's hop to an engine only adds to its own predictions and
deadlines; KV pulls are fitted per pair from this router's first->second token gaps. The parts one
by one: `RateEstimator`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from actors.protocol.request import Stamps
from actors.rates import PAIR_FLOORS, EngineRates, RidgeFit
from serving.placement_config import PlacementConfig
from serving.routing.slo_model import EngineEstimate, Role, TransferEstimate

HOP_ALPHA = 0.2  # weight of the newest hop sample

__all__ = ["EngineRates", "RateEstimator", "hop_of"]


def hop_of(stamps: tuple[tuple[str, float], ...]) -> float | None:
    """This router's delay around one engine call: its own wait less the engine's time, from the first
    token's stamps (`actors.protocol.request.Stamps`; each difference within one process); None without them."""
    at = dict(stamps)
    try:
        hop = (at[Stamps.ROUTER_IN] - at[Stamps.ROUTED]) - (at[Stamps.ENGINE_OUT] - at[Stamps.ENGINE_IN])
    except KeyError:
        return None
    return max(0.0, hop) if math.isfinite(hop) else None


class RateEstimator:
    """Engines (`rates`). The model `seconds = a * steps + b * steps * batch + c * prompt_tokens`
    (`actors.rates`) is fitted by each engine from what it serves (every router's requests, at its
    true batch and queue) and published with its queues through the coordinator's route table
    (`RouteTable.rates`, adopted with every table: `adopt`). A router does not fit engine rates
    itself: every router holding one table version reads the same numbers. An engine that published
    nothing measured yet (new, or not yet heard of) takes the pooled rates: the sample-weighted mean
    of the measured ones (a and b over `samples`, c over `prefill_samples`), or the config's priors
    while no engine measured anything; one that measured steps but no prefill takes the pooled c.

    Load (`estimate`, `prefill_s`). Queued prompt tokens, decode streams and the prompt tokens given
    per second are the larger of what this router has in flight there (exact, its own share) and
    what the engine published (every router's, as of its last publication): never counted twice,
    never below this router's own.

    Local correction (`hop_s`). The delay this router observes to an engine beyond the engine's own
    time: per first token, (router in - routed) - (engine out - engine in) of its stamps
    (`hop_of`), an exponential average per engine. It only adds that hop to this router's TTFT
    predictions and deadlines: it never moves the shared rates, and no other router sees it.

    KV pulls per pair (`transfer`): seconds = overhead + tokens / rate, fitted by this router from the
    first->second token gaps of its own streams (`observe_transfer`; a `RidgeFit` per pair, pooled
    over pairs as their prior). A pull that failed and was recomputed teaches no rate, but the first
    gap it cost (the failed wait plus the recompute: a slow link past the sync wait, a partition)
    is added to the pair's overhead (`observe_failed_transfer`), halving every
    `transfer_half_life_s` and cleared by the pair's next good pull: placement stops paying for a
    pair whose pulls fail, and tries it again once the penalty faded.
    """

    def __init__(self, config: PlacementConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.config, self.clock = config or PlacementConfig(), clock
        c = self.config
        self.prior = EngineRates(c.prior_step_s, c.prior_step_per_stream_s, 1.0 / c.prior_prefill_tokens_per_s)
        self._pair_prior = (c.prior_transfer_overhead_s, 1.0 / c.prior_transfer_tokens_per_s)
        self._pooled_pair = self._pair_fit()
        self._pairs: dict[tuple[str, str], RidgeFit] = {}
        self._failed: dict[tuple[str, str], tuple[float, float]] = {}  # pair -> (a failed pull's cost, when)
        self._pooled_transfer: tuple[tuple[float, ...] | None, TransferEstimate | None] = (None, None)
        self.published: Mapping[str, EngineRates] = {}  # the engines' own, as the last table had them
        self._pooled: EngineRates | None = None
        self._resolved: dict[str, EngineRates] = {}  # per table: engine -> its rates as `rates` answers
        self._hops: dict[str, float] = {}  # engine -> this router's hop to it (its local correction)

    def _pair_fit(self) -> RidgeFit:
        c = self.config
        return RidgeFit(self._pair_prior, PAIR_FLOORS, c.transfer_half_life_s, c.prior_weight,
                        c.min_history_weight, self.clock())

    # ------------------------------------------------------ shared (engines)
    def adopt(self, published: Mapping[str, EngineRates]) -> None:
        """The engines' own rates of a new route table (`RouteTable.rates`)."""
        if published is not self.published:
            self.published, self._pooled, self._resolved = published, None, {}

    def pooled(self) -> EngineRates:
        """What the engines measured, weighted by their samples (the priors while none measured)."""
        if self._pooled is None:
            rates = [self.published[e] for e in sorted(self.published)]  # one order: the same sums everywhere
            steps = [r for r in rates if r.measured]
            prefills = [r for r in rates if r.prefill_samples > 0]
            a, b, c = self.prior.step_s, self.prior.step_per_stream_s, self.prior.prefill_s_per_token
            if steps:
                w = sum(r.samples for r in steps)
                a = sum(r.samples * r.step_s for r in steps) / w
                b = sum(r.samples * r.step_per_stream_s for r in steps) / w
            if prefills:
                c = sum(r.prefill_samples * r.prefill_s_per_token for r in prefills) / sum(
                    r.prefill_samples for r in prefills)
            self._pooled = EngineRates(a, b, c)
        return self._pooled

    def rates(self, engine_id: str) -> EngineRates:
        """The engine's rates and load as it published them (pooled where it measured nothing yet)."""
        found = self._resolved.get(engine_id)
        if found is None:
            own, pooled = self.published.get(engine_id), self.pooled()
            if own is None:
                found = pooled
            elif not own.measured:
                found = replace(own, step_s=pooled.step_s, step_per_stream_s=pooled.step_per_stream_s,
                                prefill_s_per_token=pooled.prefill_s_per_token)
            elif own.prefill_samples <= 0:
                found = replace(own, prefill_s_per_token=pooled.prefill_s_per_token)
            else:
                found = own
            self._resolved[engine_id] = found
        return found

    def prefill_s(self, engine_id: str, tokens: int, queued: int = 0) -> float:
        """Seconds until a prompt of `tokens` is prefilled there: behind its queue (the larger of this
        router's `queued` and the engine's own), chunked by its budget, plus this router's hop."""
        r = self.rates(engine_id)
        work = max(queued, r.queued_prompt_tokens) + max(0, tokens)
        budget = r.chunk_budget_tokens or self.config.chunk_budget_fallback()
        steps = math.ceil(work / budget)
        return work * r.prefill_s_per_token + steps * r.decode_step_s(r.decode_streams) + self.hop_s(engine_id)

    def step_s(self, engine_id: str) -> float:
        """One decode step there at the batch it published."""
        r = self.rates(engine_id)
        return r.decode_step_s(r.decode_streams)

    # -------------------------------------------------- local (this router)
    def observe_hop(self, engine_id: str, seconds: float | None) -> None:
        """One call's delay beyond the engine's own time (`hop_of`), as this router saw it."""
        if seconds is None or not (seconds >= 0 and math.isfinite(seconds)):
            return
        was = self._hops.get(engine_id)
        self._hops[engine_id] = seconds if was is None else was + HOP_ALPHA * (seconds - was)

    def hop_s(self, engine_id: str) -> float:
        return self._hops.get(engine_id, 0.0)

    def observe_transfer(self, prefill_id: str, decode_id: str, tokens: int, seconds: float) -> None:
        """A KV pull of `tokens` tokens from prefill_id to decode_id took `seconds` (params in -> KV loaded)."""
        if not (seconds > 0 and math.isfinite(seconds)) or tokens < 0:
            return
        now = self.clock()
        self._pooled_pair.add((1.0, float(tokens)), seconds, now)
        self._pairs.setdefault((prefill_id, decode_id), self._pair_fit()).add((1.0, float(tokens)), seconds, now)
        self._failed.pop((prefill_id, decode_id), None)  # the pair pulls again

    def observe_failed_transfer(self, prefill_id: str, decode_id: str, seconds: float) -> None:
        """A pull from prefill_id to decode_id failed and its prompt was recomputed: the first gap it
        cost (params in -> first decode token) becomes the pair's penalty (the larger of it and what
        is left of the last one)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        pair = (prefill_id, decode_id)
        self._failed[pair] = (max(seconds, self.failure_penalty_s(*pair)), self.clock())

    def failure_penalty_s(self, prefill_id: str, decode_id: str) -> float:
        """What is left of the pair's last failed pull's cost (0 once below 10 ms)."""
        found = self._failed.get((prefill_id, decode_id))
        if found is None:
            return 0.0
        left = found[0] * 0.5 ** ((self.clock() - found[1]) / self.config.transfer_half_life_s)
        if left < 0.01:
            del self._failed[(prefill_id, decode_id)]
            return 0.0
        return left

    def transfer(self, prefill_id: str, decode_id: str) -> TransferEstimate:
        """The pair's pull estimate (a `slo_model.TransferOf`), its failure penalty included."""
        estimate = self._fitted_transfer(prefill_id, decode_id)
        if self._failed:
            penalty = self.failure_penalty_s(prefill_id, decode_id)
            if penalty:
                return TransferEstimate(estimate.tokens_per_s, estimate.overhead_s + penalty)
        return estimate

    def _fitted_transfer(self, prefill_id: str, decode_id: str) -> TransferEstimate:
        now = self.clock()
        pooled = self._pooled_pair.solve(self._pair_prior, now)
        fit = self._pairs.get((prefill_id, decode_id))
        if fit is not None:
            overhead, per_token = fit.solve(pooled, now)
            return TransferEstimate(tokens_per_s=1.0 / per_token, overhead_s=overhead)
        if self._pooled_transfer[0] is not pooled:  # pairs never measured share the pooled estimate
            self._pooled_transfer = (pooled, TransferEstimate(tokens_per_s=1.0 / pooled[1], overhead_s=pooled[0]))
        return self._pooled_transfer[1]

    def pairs(self) -> dict[tuple[str, str], TransferEstimate]:
        """Every pair this router measured a pull of, or saw a pull of fail, with its estimate."""
        return {p: self.transfer(*p) for p in sorted({*self._pairs, *self._failed})}

    def forget(self, engine_id: str) -> None:
        """The engine left the pool: drop this router's hop to it and its pairs (the pooled fit keeps them)."""
        self._hops.pop(engine_id, None)
        for pair in [p for p in self._pairs if engine_id in p]:
            del self._pairs[pair]
        for pair in [p for p in self._failed if engine_id in p]:
            del self._failed[pair]

    # ----------------------------------------------------------- estimates
    def estimate(self, engine_id: str, role: Role, *, decode_streams: int = 0, queued_prefill_tokens: int = 0,
                 cached_tokens: int = 0, chunk_budget_tokens: int | None = None,
                 prefill_busy: float = 0.0, fresh_streams: int = 0) -> EngineEstimate:
        """What `placement.place` needs about one engine: its shared rates, the load of this router
        there or the engine's own (the larger), its budget (its own, else `chunk_budget_tokens`), the hop."""
        r = self.rates(engine_id)
        streams = max(decode_streams, r.decode_streams)
        return EngineEstimate(engine_id, role, r.prefill_tokens_per_s, r.decode_step_s(streams),
                              r.chunk_budget_tokens or chunk_budget_tokens or self.config.chunk_budget_fallback(),
                              r.step_per_stream_s, cached_tokens, max(queued_prefill_tokens, r.queued_prompt_tokens),
                              streams, fresh_streams, prefill_busy, self.hop_s(engine_id))
