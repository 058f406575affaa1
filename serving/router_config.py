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
    """Engine choice and colocated-vs-disaggregated placement (serving/routing/planner.py)."""

    # cache_aware: engines publish vLLM's KV cache events and the router counts each engine's cached
    # prefix of the prompt; least_outstanding: load alone, and engines run without KV events
    policy: Literal["least_outstanding", "cache_aware"] = "cache_aware"
    cache_weight: float = Field(1.0, ge=0)  # cost of one uncached prompt token vs one token of queued work
    # slo: per request, the SLO model (serving/routing/placement.py) picks colocated or disaggregated and
    # where; disaggregate: every request is prefilled remotely whenever a prefill engine is usable
    placement: Literal["slo", "disaggregate"] = "slo"
    slo: PlacementConfig = PlacementConfig()  # targets, weights and the priors rates start from
    index_refresh_s: float = Field(0.1, gt=0)  # how stale the router's copy of the prefix index may get
    no_prefill_fallback: Literal["decode_local", "reject"] = "decode_local"
    prefill_retries: int = Field(1, ge=0, le=3)
    # a stream whose decode engine died (or hung) waits this long for one to take it (another, or the
    # restarted one); past it the stream ends with an error event
    migration_wait_s: float = Field(15.0, ge=0)
    # Deadlines of the engine calls a client waits for (formulas: serving/routing/deadlines.py):
    # a prefill call or a stream's first chunk gets floor + margin x the prefill's predicted time at
    # the engine's own published rates and queue (the priors of `slo` until it measured them; +
    # transfer.read_timeout_s when the decode engine pulls KV first); every later chunk
    # max(token_timeout_s, margin x the engine's step at its published batch). A wait past its
    # deadline goes on while the engine answers other calls (silent < token_timeout_s), up to margin x
    # its deadline: busy is not hung. An engine that misses one is treated as hung: its streams
    # migrate, the coordinator is told (it probes, evicts and restarts the engine), and this router
    # gives it no work meanwhile.
    deadline_floor_s: float = Field(10.0, gt=0)
    deadline_margin: float = Field(3.0, ge=1.0)
    token_timeout_s: float = Field(10.0, gt=0)  # per-token inactivity of a stream (floor)
    # a suspected engine gets no new work from this router this long, unless the directory lists a
    # new incarnation of it sooner (the coordinator's probe decides within restarts.probe_timeout_s)
    hung_engine_hold_s: float = Field(30.0, gt=0)
    directory_ttl_s: float = Field(1.0, ge=0)  # how old the router's copy of the route table may get
    probe_timeout_s: float = Field(0.5, gt=0)  # a request waits this long at most to win a half-open pair's probe
    # a won probe is held this long for a request to carry it (None: half of breaker.probe_window_s)
    probe_hold_s: float | None = Field(None, gt=0)
    # the decode engines' own bound on a KV pull, added to a remote prefill's deadline (None: transfer.read_timeout_s)
    pull_timeout_s: float | None = Field(None, gt=0)

    def resolved(self, transfer: TransferConfig | None = None, breaker: BreakerConfig | None = None) -> "RouterConfig":
        """This config with the settings it takes from the `transfer:` and `breaker:` sections filled
        in where unset (their defaults when not given)."""
        transfer, breaker = transfer or TransferConfig(), breaker or BreakerConfig()
        return self.model_copy(update={
            "probe_hold_s": self.probe_hold_s or breaker.probe_window_s / 2,  # well within the ledger's window
            "pull_timeout_s": self.pull_timeout_s or transfer.read_timeout_s})
