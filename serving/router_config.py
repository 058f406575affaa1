"""The router's settings (a deployment's `router:` section), as plain config.

Engine choice, colocated-vs-disaggregated placement and its SLO model (`router.slo`), the deadlines of
the engine calls a client waits for, and the half-open probes. It lives beside serving/config.py and
imports nothing of serving/ but the other config parts, so that the routing layer imports it from the
config floor, never the other way round.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from actors.config_base import StrictModel
from actors.control.breaker_config import BreakerConfig
from actors.transfer_config import TransferConfig
from serving.placement_config import PlacementConfig


class RouterConfig(StrictModel):
    """Engine choice and colocated-vs-disaggregated placement (serving/routing/planner.py).

    Deadlines of the engine calls a client waits for (formulas: serving/routing/deadlines.py): a
    prefill call or a stream's first chunk gets floor + margin x the prefill's predicted time at the
    engine's own published rates and queue (+ the pull's bound when the decode engine pulls KV first);
    every later chunk max(token_timeout_s, margin x the engine's step). A wait past its deadline goes
    on while the engine answers other calls, up to margin x its deadline: busy is not hung. An engine
    that misses one is treated as hung: its streams migrate, the coordinator is told, and this router
    gives it no work for `hung_engine_hold_s`."""

    policy: Literal["least_outstanding", "cache_aware"] = Field("cache_aware", description=(
        "`cache_aware`: engines publish vLLM's KV cache events and the router counts each engine's cached "
        "prefix of the prompt; `least_outstanding`: load alone, engines run without KV events"))
    cache_weight: float = Field(1.0, ge=0, description=(
        "what one uncached prompt token weighs against one token of queued work"))
    placement: Literal["slo", "disaggregate", "colocate"] = Field("slo", description=(
        "`slo`: per request, the SLO model picks colocated or disaggregated and where; `disaggregate`: "
        "every request is prefilled on a prefill engine whenever one is usable; `colocate`: the SLO "
        "model's colocated options only, no KV is pulled (role-flexible engines, e.g. across a slow network)"))
    slo: PlacementConfig = PlacementConfig()
    index_refresh_s: float = Field(0.1, gt=0, description="how old the router's copy of the prefix index may get")
    no_prefill_fallback: Literal["decode_local", "reject"] = Field("decode_local", description=(
        "no usable prefill engine: prefill on the decode engine, or `reject` the request (503)"))
    prefill_retries: int = Field(1, ge=0, le=3, description=(
        "a prefill that failed because of its engine is retried this often on another prefill engine"))
    migration_wait_s: float = Field(15.0, ge=0, description=(
        "a stream whose decode engine died or hung waits this long for another (or the restarted one) to "
        "take it over; past it the stream ends with an error event"))
    deadline_floor_s: float = Field(10.0, gt=0, description=(
        "the floor of a prefill call's, or a stream's first chunk's, deadline"))
    deadline_margin: float = Field(3.0, ge=1.0, description=(
        "deadlines are this x the call's predicted time (on top of the floor)"))
    token_timeout_s: float = Field(10.0, gt=0, description=(
        "every later chunk of a stream must come within max(this, margin x the engine's step); a wait "
        "past its deadline goes on while the engine is heard from within this long"))
    hung_engine_hold_s: float = Field(30.0, gt=0, description=(
        "an engine that missed a deadline gets no new work from this router this long, unless a new "
        "incarnation of it registers sooner"))
    directory_ttl_s: float = Field(1.0, ge=0, description="how old the router's copy of the route table may get")
    probe_timeout_s: float = Field(0.5, gt=0, description=(
        "a request waits at most this long to win a half-open pair's probe (only when no closed pair is left)"))
    probe_hold_s: float | None = Field(None, gt=0, description=(
        "a won probe is held this long for a request to carry it (unset: half of `breaker.probe_window_s`)"))
    pull_timeout_s: float | None = Field(None, gt=0, description=(
        "the decode engines' bound on a KV pull, added to a remote prefill's deadline (unset: "
        "`transfer.read_timeout_s`)"))

    def resolved(self, transfer: TransferConfig | None = None, breaker: BreakerConfig | None = None) -> "RouterConfig":
        """This config with the settings it takes from the `transfer:` and `breaker:` sections filled
        in where unset (their defaults when not given)."""
        transfer, breaker = transfer or TransferConfig(), breaker or BreakerConfig()
        return self.model_copy(update={
            "probe_hold_s": self.probe_hold_s or breaker.probe_window_s / 2,  # well within the ledger's window
            "pull_timeout_s": self.pull_timeout_s or transfer.read_timeout_s})
