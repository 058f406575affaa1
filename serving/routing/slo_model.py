"""SLO-aware placement of one request (pure: no Ray, no asyncio): colocated or disaggregated, and where.

Options: colocated on X (role decode or both); disaggregated: prefill on Y (role prefill or both,
Y != X), decode on X. `allowed(prefill_id, decode_id)` (None for colocated) is the deployment's
filter: compatibility, breakers, `no_prefill_fallback: reject`. Each option's TTFT, stall of the
streams it would interrupt, first gap and own ITL are predicted from the engines' own rates
(`predict`), weighed against the targets, and the least violation wins (`place`), with the reason
that decided it. The static thresholds of earlier placements (`short_prompt_tokens`,
`prefill_saturation_tokens`) are special cases of it. `chunked_prefill_budget`
(`serving.placement_config`) picks the chunk budget so one local prefill step stays within the ITL
target; `serving.sizing.live` simulates pools placed by this model for scaling advice.
docs/placement.md has the reasoning and the knobs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from serving.placement_config import PlacementConfig, vllm_default_budget
from serving.routing.decisions import DecisionReason

Role = Literal["prefill", "decode", "both"]
PREFILL_CAPABLE: frozenset[str] = frozenset({"prefill", "both"})
DECODE_CAPABLE: frozenset[str] = frozenset({"decode", "both"})
_EPS = 1e-9


@dataclass(frozen=True)
class EngineEstimate:
    """One engine as placement sees it: its learned rates and its load now (and this prompt's cache hit)."""

    engine_id: str
    role: Role
    prefill_tokens_per_s: float  # marginal rate (step overheads are in decode_step_s)
    decode_step_s: float  # one step at its current batch; a prefill-only engine: its bare step
    chunk_budget_tokens: int = field(default_factory=lambda: vllm_default_budget({}))  # `vllm serve`'s
    step_per_stream_s: float = 0.0  # what one more stream adds to a step (own ITL, the planner's simulation)
    cached_tokens: int = 0  # prefix of this prompt whose KV the engine holds (prefix index)
    queued_prefill_tokens: int = 0  # prompt tokens waiting or being prefilled there
    decode_streams: int = 0  # streams decoding there now
    fresh_streams: int = 0  # of those (or on their way), the ones still owed their second token
    prefill_busy: float = 0.0  # share of its recent time spent prefilling (0..1)
    hop_s: float = 0.0  # the caller's own delay to it beyond its compute (a router's local correction)

    def __post_init__(self) -> None:
        if (self.prefill_tokens_per_s <= 0 or self.decode_step_s < 0 or self.step_per_stream_s < 0
                or self.chunk_budget_tokens < 1 or self.hop_s < 0 or self.fresh_streams < 0):
            raise ValueError(f"engine {self.engine_id}: rates must be positive and the budget >= 1")

    def prefill_work_s(self, tokens: float) -> float:
        """Seconds to prefill `tokens` from an empty queue (chunked, decodes riding along)."""
        return tokens / self.prefill_tokens_per_s + math.ceil(tokens / self.chunk_budget_tokens) * self.decode_step_s

    @property
    def bare_step_s(self) -> float:
        return max(0.0, self.decode_step_s - self.step_per_stream_s * self.decode_streams)


@dataclass(frozen=True)
class TransferEstimate:
    """A KV pull between one pair: fixed overhead plus tokens at a rate."""

    tokens_per_s: float
    overhead_s: float = 0.0

    def seconds(self, tokens: int) -> float:
        return self.overhead_s + max(0, tokens) / self.tokens_per_s


class Option(NamedTuple):  # a tuple: one per allowed pair per request, built fast, hashable
    decode_id: str
    prefill_id: str | None = None  # None: colocated

    @property
    def kind(self) -> Literal["colocated", "disagg"]:
        return "colocated" if self.prefill_id is None else "disagg"


@dataclass(slots=True)  # not frozen: one per option per request, and frozen construction costs 4x
class Prediction:
    option: Option
    uncached_tokens: int  # computed by the prefilling engine
    queue_wait_s: float  # its queue ahead of this prompt
    compute_s: float  # this prompt's own chunks
    handoff_s: float  # the remote path's extra before the first token
    first_gap_s: float
    own_itl_s: float
    stalled_streams: int  # streams on the prefilling engine this prefill stalls
    stalled_steps: int
    stall_gap_s: float  # their worst gap during it (0: nobody stalled)
    ttft_violation_s: float
    itl_violation_s: float  # stream-seconds past the ITL targets
    violation: float  # weighted sum: what the choice minimizes

    @property
    def ttft_s(self) -> float:
        return self.queue_wait_s + self.compute_s + self.handoff_s

    @property
    def meets_slo(self) -> bool:
        return self.ttft_violation_s <= _EPS and self.itl_violation_s <= _EPS


@dataclass(frozen=True)
class Placement:
    option: Option
    why: DecisionReason  # what made this option win
    prediction: Prediction
    alternative: Prediction | None  # the best option of the other kind
    ttft_target_s: float
    predictions: tuple[Prediction, ...] = field(default=(), repr=False)  # every option, best first

    @property
    def reason(self) -> str:
        """The option's kind and why, as shown: "disagg/itl_protect"."""
        return f"{self.option.kind}/{self.why}"

    @property
    def meets_slo(self) -> bool:
        return self.prediction.meets_slo


Allowed = Callable[[str | None, str], bool]  # (prefill id or None for colocated, decode id) -> allowed
TransferOf = Callable[[str, str], TransferEstimate]  # (prefill id, decode id) -> that pair's pull


def options(engines: Sequence[EngineEstimate], allowed: Allowed | None = None) -> list[Option]:
    """Every option the roles and `allowed` permit, colocated ones first per decode engine."""
    ok = allowed or (lambda _p, _d: True)
    prefilling = [y.engine_id for y in engines if y.role in PREFILL_CAPABLE]
    out: list[Option] = []
    for x in engines:
        if x.role not in DECODE_CAPABLE:
            continue
        d = x.engine_id
        if ok(None, d):
            out.append(Option(d))
        out += [Option(d, p) for p in prefilling if p != d and ok(p, d)]
    return out


def ttft_target(prompt_tokens: int, engines: Sequence[EngineEstimate], config: PlacementConfig) -> float:
    """The floor, or `ttft_slowdown` x what the prompt costs uncached and unqueued on the fastest engine."""
    if not engines or not config.ttft_slowdown:
        return config.ttft_target_s
    best = min(e.prefill_work_s(prompt_tokens) for e in engines)
    return max(config.ttft_target_s, config.ttft_slowdown * best)


@dataclass(slots=True)
class _PrefillSide:
    """What an option's prefilling engine E contributes, the same for every decode engine it may serve."""
    uncached: int
    wait_s: float
    done_s: float
    streams: int
    steps: int
    stall_gap_s: float
    stall_violation_s: float  # stream-seconds E's streams lose past the ITL target


@dataclass(slots=True)
class _DecodeSide:
    """What the decode engine X contributes, whoever prefills."""
    own_itl_s: float
    colocated_gap_s: float
    local_chunk_s: float  # its own prefill chunk in its steps (after a pull)
    uncached: int  # prompt tokens X's cache lacks (what a pull moves)
    slow_decode_s: float  # answer tokens x past the mean ITL target


def _prefill_side(e: EngineEstimate, prompt_tokens: int, config: PlacementConfig, answer_tokens: int) -> _PrefillSide:
    u = max(1, prompt_tokens - min(e.cached_tokens, prompt_tokens))
    q, r, b, s = e.queued_prefill_tokens, e.prefill_tokens_per_s, e.chunk_budget_tokens, e.decode_step_s
    done = (q + u) / r + math.ceil((q + u) / b) * s
    wait = min(done, q / r + (q // b) * s)
    done += e.hop_s
    streams, steps = e.decode_streams, math.ceil(u / b)
    if not streams and not e.fresh_streams:
        return _PrefillSide(u, wait, done, 0, steps, 0.0, 0.0)
    chunk_s = min(q + u, b) / r
    # a fresh stream's second token waits for the next step: a chunk there stretches that one gap,
    # which no TPOT budget excuses (it is the gap a user sees first)
    fresh_cost = e.fresh_streams * max(0.0, s + chunk_s - config.itl_target_s)
    # each stream's answer has a TPOT budget (answer tokens x the mean ITL target): the stall
    # (steps x chunk_s) costs the lesser of what it adds past that budget (after what E's own
    # prefill share already takes of it) and what it adds past the per-step target
    answer = max(1, answer_tokens)
    over_budget = answer * (_mean_gap(e, config) - _mean_itl_target(e, config))
    past_budget = max(0.0, over_budget + steps * chunk_s) - max(0.0, over_budget)
    past_gap = steps * max(0.0, s + chunk_s - config.itl_target_s)
    return _PrefillSide(u, wait, done, streams, steps, s + chunk_s,
                        streams * min(past_budget, past_gap) + fresh_cost)


def _prefill_share(x: EngineEstimate, config: PlacementConfig) -> float:
    """The share of X's time spent prefilling, as the model uses it (capped at `max_prefill_busy`)."""
    return min(config.max_prefill_busy, max(0.0, x.prefill_busy))


def _mean_gap(x: EngineEstimate, config: PlacementConfig) -> float:
    """A stream's mean gap on X: its step, stretched by the share of X's time spent prefilling."""
    return x.decode_step_s / (1.0 - _prefill_share(x, config))


def _mean_itl_target(x: EngineEstimate, config: PlacementConfig) -> float:
    return max(config.itl_target_mean_s, config.mean_itl_slowdown * (x.bare_step_s + x.step_per_stream_s))


def _decode_side(x: EngineEstimate, prompt_tokens: int, config: PlacementConfig, answer_tokens: int) -> _DecodeSide:
    own_itl = (x.decode_step_s + x.step_per_stream_s) / (1.0 - _prefill_share(x, config))
    local_chunk = min(x.queued_prefill_tokens, x.chunk_budget_tokens) / x.prefill_tokens_per_s
    return _DecodeSide(own_itl, x.decode_step_s + x.step_per_stream_s, local_chunk,
                       prompt_tokens - min(x.cached_tokens, prompt_tokens),
                       max(1, answer_tokens) * max(0.0, own_itl - _mean_itl_target(x, config)))


def predict(opts: Sequence[Option], engines: dict[str, EngineEstimate], prompt_tokens: int, config: PlacementConfig,
            target_s: float, transfer: TransferOf | None = None, answer_tokens: int = 1) -> list[Prediction]:
    """TTFT, gaps and violations of each option; each engine's parts are computed once for all the
    options it is in (one loop, not a call per option).

    Per engine E (`EngineEstimate`): r = prefill tokens/s, s = step time of its
    current decode batch (a prefill-only engine: its bare step), B = chunked-prefill
    budget (vLLM's max_num_batched_tokens), q = prompt tokens queued or prefilling,
    n = streams decoding, c = this prompt's prefix E holds, h = the caller's own hop
    to E (the router's local correction; 0 when unknown). Prompt of P tokens.
    For an option whose prefilling engine is E (Y, or X when colocated):

      u          = max(1, P - c_E)               (vLLM recomputes at least the last token)
      steps      = ceil((q + u) / B)              every step carries at most B prompt tokens
      TTFT       = (q + u) / r + steps * s + h [+ remote_first_token_overhead_s]
                   (the first token streams from E: the KV pull is not in TTFT)
      stall gap  = s + min(q + u, B) / r          what each of E's n streams waits per step,
                   for ceil(u / B) steps of this request
      stall cost = per stream, the lesser of what the stall adds past the per-step target,
                   ceil(u/B) * max(0, stall gap - itl_target), and what it adds past the stream's TPOT
                   budget, max(0, over + ceil(u/B) * (stall gap - s)) - max(0, over), where
                   over = A * (s / (1 - rho_E) - mean target) (its steps, stretched by E's own prefill
                   share, against the mean ITL target; A: this request's answer tokens, standing in
                   for theirs). A stall that stays within either costs nothing;
                   plus, per fresh stream f (still owed its second token), max(0, stall gap - itl_target):
                   its first->second gap, which no TPOT budget excuses
      first gap  colocated: s_X;  disaggregated: pull(Y->X, P - c_X) + s_X + min(q_X, B_X) / r_X
                   (pull = the pair's overhead + tokens / its rate; X's own prefill chunks share its steps)
      own ITL    = (s_X + what one more stream adds to X's step) / (1 - rho_X): rho_X is the share of
                   its recent time X spent prefilling (prefill tokens it was given per second / r_X,
                   capped at `max_prefill_busy`): a stream placed on an engine that keeps prefilling
                   is stalled by those prefills for its whole life. This is what makes the P/D split
                   emerge on role-flexible engines: streams gather where little is prefilled, prompts
                   go where few streams would be stalled.

    Targets: TTFT target = max(ttft_target_s, ttft_slowdown * P / fastest r) (a
    long prompt has a longer budget, as the benchmark's SLO gives it);
    `itl_target_s` per step; mean target = max(itl_target_mean_s, mean_itl_slowdown *
    bare step) for a stream's mean ITL (TPOT); `first_gap_target_s` (unset: `itl_target_s`) for the
    first->second token gap. `raypd config --plan` sets ttft_target_s and
    itl_target_mean_s to the user's targets.
    Violation (seconds, weighted):

      ttft_weight * max(0, TTFT - target)
      + itl_weight * (stall cost of E's n streams (f of them fresh)      (the stream-seconds they lose)
                      + max(0, first gap - first_gap_target)
                      + A * max(0, own ITL - mean target of X))
                      (A = the answer's tokens: the seconds its whole stream loses to a slow decode engine)
    """
    prefilling: dict[str, _PrefillSide] = {}
    decoding: dict[str, _DecodeSide] = {}
    pull_of = transfer or _prior_transfer(config)
    overhead, gap_target = config.remote_first_token_overhead_s, config.first_gap_target_s or config.itl_target_s
    ttft_w, itl_w = config.ttft_weight, config.itl_weight
    out = []
    for option in opts:
        decode_id, prefill_id = option
        e_id = prefill_id or decode_id
        e = prefilling.get(e_id)
        if e is None:
            e = prefilling[e_id] = _prefill_side(engines[e_id], prompt_tokens, config, answer_tokens)
        x = decoding.get(decode_id)
        if x is None:
            x = decoding[decode_id] = _decode_side(engines[decode_id], prompt_tokens, config, answer_tokens)
        if prefill_id is None:
            handoff, first_gap = 0.0, x.colocated_gap_s
        else:
            handoff = overhead
            first_gap = pull_of(prefill_id, decode_id).seconds(x.uncached) + x.own_itl_s + x.local_chunk_s
        ttft_v = e.done_s + handoff - target_s
        ttft_v = ttft_v if ttft_v > 0.0 else 0.0
        gap_v = first_gap - gap_target
        itl_v = e.stall_violation_s + (gap_v if gap_v > 0.0 else 0.0) + x.slow_decode_s
        out.append(Prediction(option, e.uncached, e.wait_s, e.done_s - e.wait_s, handoff, first_gap, x.own_itl_s,
                              e.streams, e.steps if e.streams else 0, e.stall_gap_s, ttft_v, itl_v,
                              ttft_w * ttft_v + itl_w * itl_v))
    return out


def _prior_transfer(config: PlacementConfig) -> TransferOf:
    prior = TransferEstimate(config.prior_transfer_tokens_per_s, config.prior_transfer_overhead_s)
    return lambda _p, _d: prior


def place(prompt_tokens: int, engines: Sequence[EngineEstimate], config: PlacementConfig | None = None,
          transfer: TransferOf | None = None, allowed: Allowed | None = None,
          answer_tokens: int = 1) -> Placement | None:
    """The best allowed option for a prompt of `prompt_tokens`, with its reason; None without any option.

    Choice: least violation, then least TTFT, then the caller's order (it rotates
    equals for round robin). All options that meet both targets have violation 0,
    so among them the fastest first token wins; when none meets them, the least
    weighted violation does.

    The reason (`Placement.why`; shown as "<colocated|disagg>/<why>"), from the chosen option and the best option
    of the other kind (`Placement.alternative`):
      colocated/no_prefill_engine, disagg/only_option   the other kind is not allowed / has no engine;
      <kind>/itl_protect     the other kind violates the ITL targets more (X's streams stalled,
                             or a slow pull) by more than it gains in TTFT;
      <kind>/prefill_queue   decided by TTFT, mostly the other option's prefill queue (q / r);
      <kind>/prefix_cached   decided by TTFT, mostly the prompt prefix the chosen prefill engine holds;
      <kind>/ttft            decided by TTFT otherwise (the handoff saved, a faster or idler engine).
    `Placement.meets_slo` says whether the choice is predicted to meet both targets.
    """
    if prompt_tokens < 1:
        raise ValueError("a prompt has at least one token")
    config = config or PlacementConfig()
    by_id = {e.engine_id: e for e in engines}
    if len(by_id) != len(engines):
        raise ValueError("engine ids must be unique")
    opts = options(engines, allowed)
    if not opts:
        return None
    target = ttft_target(prompt_tokens, engines, config)
    preds = predict(opts, by_id, prompt_tokens, config, target, transfer, answer_tokens)
    keys = [(round(p.violation, 6), round(p.queue_wait_s + p.compute_s + p.handoff_s, 6)) for p in preds]  # ttft_s
    order = sorted(range(len(preds)), key=keys.__getitem__)  # stable: equals keep the caller's order
    ranked = tuple(preds[i] for i in order)
    best = ranked[0]
    alternative = next((p for p in ranked if p.option.kind != best.option.kind), None)
    return Placement(best.option, _reason(best, alternative, config), best, alternative, target, ranked)


def _reason(chosen: Prediction, alt: Prediction | None, config: PlacementConfig) -> DecisionReason:
    if alt is None:
        colocated = chosen.option.kind == "colocated"
        return DecisionReason.NO_PREFILL_ENGINE if colocated else DecisionReason.ONLY_OPTION
    d_ttft = config.ttft_weight * (alt.ttft_violation_s - chosen.ttft_violation_s)
    d_itl = config.itl_weight * (alt.itl_violation_s - chosen.itl_violation_s)
    if d_itl > _EPS and d_itl >= d_ttft:
        return DecisionReason.ITL_PROTECT
    # decided by the first token: which part of the alternative's TTFT made it slower
    per_token = alt.compute_s / alt.uncached_tokens
    parts = {DecisionReason.PREFILL_QUEUE: alt.queue_wait_s - chosen.queue_wait_s,
             DecisionReason.PREFIX_CACHED: (alt.uncached_tokens - chosen.uncached_tokens) * per_token}
    why, gain = max(parts.items(), key=lambda kv: kv[1])
    # a part explains the choice when it outweighs the rest of the difference (handoff, rates)
    rest = (alt.ttft_s - chosen.ttft_s) - gain
    return why if gain > _EPS and gain >= rest else DecisionReason.TTFT
